"""``MODEL=ds41``: verl's own PPO trainer (main_ppo, v1, Ray) with a GAE critic on the tiny DeepSeek-V4.1 at CP=2.

The real run: ``MODEL=ds41 scripts/run_ds4_proxy_ppo_cpu.sh`` (recipe ``ds4_proxy_ppo_cpu``), 2 steps of 8
prompts, response <= 8, with verl's router replay R2 and verl-ds4's indexer replay (``INDEXER_REPLAY=1``) on the actor
(``actor_rollout_ref.actor.megatron.router_replay.mode=R2``: the old-log-prob pass records every V4.1
router's routes, the actor update replays them; verl's engine raises "R2 RECORD completed without capturing
any router routes" when no router is wired), under the guard of the other CPU RL tests
(:func:`verl_ds4.rollout.cpu_ppo_run.run_guarded`: wall-clock and process-tree RSS limits). Actor,
reference and critic are ``DS41MegatronModel`` built by the ``deepseek_v41`` CPU builder (the critic with
its value head). Controls: the V4 runs of ``test_cpu_ppo_on_cpu.py`` / the GRPO run of
``test_cluster_launchers_real_on_cpu.py`` build "DS4 model" where this log must show the V4.1 builder, and KL is 0
before the first update and positive after it (the update moved the actor); the rollout and the actor's CP=2
recompute agree after the weight sync.

Cost: one launch: 322 s for the module (console wall time 4m45s, peak RSS 8.3 GB) measured beside a 60-step
RL benchmark and other jobs on the 2 shared cores; the V4 runs' ~2.5 minutes on a quieter machine.
"""

from __future__ import annotations

import math
import os

import pytest

from verl_ds4.testing.cpu_rl import run_cpu_rl_launcher

TIMEOUT_S = float(os.environ.get("VERL_DS4_CPU_RL_TIMEOUT_S", "1200"))  # a hang guard: about 100-200 s a launch
RSS_LIMIT_GB = 12.0
GATE_MAX = 1e-5
BATCH = 8  # PPO: verl needs a multiple of its minimal batch (8 here)


@pytest.fixture(scope="module")
def ds41_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("ds41_ppo")
    env = {"MODEL": "ds41", "DS4_RL_RECIPE": "ppo", "STEPS": "2", "N_TRAIN": "32", "BATCH": str(BATCH),
           "RESPONSE_LENGTH": "8", "MISMATCH_MAX": str(GATE_MAX), "INDEXER_REPLAY": "1"}
    result = run_cpu_rl_launcher(work, env, timeout_s=TIMEOUT_S, rss_limit_gb=RSS_LIMIT_GB,
                                 args=["actor_rollout_ref.actor.megatron.router_replay.mode=R2"])
    print(f"\nCPU PPO, MODEL=ds41: 2 steps in {result.wall_s:.0f} s, peak RSS {result.peak_rss_gb:.1f} GB")
    print(result.console)
    return work, result


def test_ds41_ppo_console_and_builder(ds41_run):
    work, result = ds41_run
    lines = result.console.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("[verl-ds4] step ")] == ["1/2", "2/2"]
    assert any(line.startswith("[verl-ds4] reward: first 1 steps mean ") for line in lines), result.console
    # actor / reference with the LM head and the critic with the value head, all from the V4.1 builder
    assert "DeepSeek-V4.1 model (8 layers" in result.log and "LM head): weights from" in result.log
    assert "value head (hidden -> 1, seeded)): weights from" in result.log
    assert "[verl-ds4 cpu] DS4 model (" not in result.log  # the V4 builder's line (the V4 runs' control)
    for engine in ("CPUMegatronEngineWithLMHead", "CPUMegatronEngineWithValueHead"):
        assert f"{engine}: contiguous CP layout (cp=2" in result.log
    assert "'mode': 'R2'" in result.log, "the resolved config should show router_replay.mode R2"
    # indexer replay (INDEXER_REPLAY=1): the actor replayed the rollout's choices, no token tolerated
    assert "indexer replay on (INDEXER_REPLAY)" in result.console and "MISMATCH_TOKENS" not in result.console
    assert "verl-ds4 indexer replay: replaying the rollout's choices" in result.log
    # verl's engine turned replay on in the actor's config (the builder then wires the routers), not elsewhere
    assert "moe_enable_routing_replay=True" in result.log and "moe_enable_routing_replay=False" in result.log
    step_dir = work / "checkpoints" / "global_step_2"
    assert (step_dir / "actor" / "model").is_dir() and (step_dir / "critic" / "model").is_dir()
    assert result.peak_rss_gb < RSS_LIMIT_GB and result.wall_s < TIMEOUT_S


def test_ds41_ppo_metrics(ds41_run):
    _, result = ds41_run
    assert sorted(result.metrics) == [1, 2], "verl printed no metrics for steps 1 and 2"
    for step, m in result.metrics.items():
        for key in ("critic/score/mean", "critic/vf_loss", "critic/values/mean", "actor/kl_loss", "actor/pg_loss",
                    "critic/advantages/mean", "timing_s/update_critic", "timing_s/step"):
            assert key in m and math.isfinite(m[key]), f"step {step}: {key} missing or not finite"
        assert 0.0 <= m["critic/score/min"] <= m["critic/score/mean"] <= m["critic/score/max"] <= 1.0
        assert m["critic/vf_loss"] > 0
        diff = m["training/rollout_log_probs_diff_max"]
        assert 0.0 <= diff <= GATE_MAX, f"step {step}: rollout vs actor (CP=2) max abs log-prob difference {diff}"
    assert result.metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert result.metrics[2]["actor/kl_loss"] > 1e-6, "the first update did not move the actor"
