"""verl's PPO trainer (main_ppo, v1, Ray) on the production engine, on CPU: Megatron-LM dev's DS4 built by
Megatron-Bridge's provider inside verl's Megatron engine for the actor, the reference and the critic (the Bridge-built
model with its value head), CP 2 with the contiguous layout, 2 steps.

The real run: ``ENGINE=production scripts/run_ds4_proxy_ppo_cpu.sh`` (recipe ``ds4_proxy_ppo_cpu``). The rollout is
dev's model too (:class:`verl_ds4.rollout.production_policy.ProductionCPUPolicy`), synced each step from the actor's
Megatron weights by Bridge's HF export; the launcher's mismatch gate stops the run if any rollout log-prob is more
than 1e-5 off the actor's (so a sync that loses or mis-maps a tensor fails the run; the gate's own negative controls
are in test_cpu_ppo_on_cpu.py). Negative controls here: the launcher refuses the production engine with the
attention-only proxy, with checkpoints and an unknown ENGINE before starting anything.

Lane 2 only (Python 3.12, megatron-bridge); skipped where no Megatron-LM dev export can be found, with the command
that makes one. GRPO on this engine (actor and reference only) is the same run with ``DS4_RL_RECIPE=grpo``; its
figures are in docs/rl-on-a-laptop.md ("The production engine").
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from verl_ds4.substitutes import megatron_dev
from verl_ds4.testing.cpu_rl import REPO, run_cpu_rl_launcher
from verl_ds4.testing.megatron_dev_export import production_marks

TIMEOUT_S = float(os.environ.get("VERL_DS4_CPU_RL_TIMEOUT_S", "900"))
RSS_LIMIT_GB = 12.0

pytestmark = production_marks(megatron_dev.DEFAULT_COMMIT)


def _launch(tmp_path, **knobs):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "WORK_DIR": str(tmp_path), "ENGINE": "production", **knobs}
    return subprocess.run(["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_launcher_refuses_what_the_production_engine_cannot_do(tmp_path):
    proc = _launch(tmp_path, MODEL="ds4_proxy")
    assert proc.returncode == 2 and "ENGINE=production with MODEL=ds4_proxy" in proc.stderr, proc.stderr
    proc = _launch(tmp_path, SAVE_FREQ="1")
    assert proc.returncode == 2 and "ENGINE=production with SAVE_FREQ=1" in proc.stderr, proc.stderr
    proc = _launch(tmp_path, ENGINE="megatron")
    assert proc.returncode == 2 and "ENGINE=megatron: expected project" in proc.stderr, proc.stderr
    assert not (tmp_path / "assets").exists(), "refused at start-up, before writing anything"


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("production_ppo")
    env = {"ENGINE": "production", "STEPS": "2", "N_TRAIN": "32", "BATCH": "8", "RESPONSE_LENGTH": "8"}
    result = run_cpu_rl_launcher(work, env, timeout_s=TIMEOUT_S, rss_limit_gb=RSS_LIMIT_GB)
    print(f"\nproduction PPO: 2 steps in {result.wall_s:.0f} s, peak RSS {result.peak_rss_gb:.1f} GB")
    print(result.console)
    return work, result


def test_actor_reference_and_critic_are_dev_s_model_built_by_bridge(ppo_run):
    _, result = ppo_run
    assert "[verl-ds4] engine      production (Megatron-LM dev's DS4 built by Megatron-Bridge" in result.console
    assert "megatron_dev_" + megatron_dev.DEFAULT_COMMIT[:8] in result.console
    # verl's engine classes of the production engine (the project engine's are CPUMegatronEngineWith*)
    assert "resolved by ProductionCPUMegatronEngineWithLMHead" in result.console, result.console
    assert "resolved by ProductionCPUMegatronEngineWithValueHead" in result.console, result.console
    assert "resolved by CPUMegatronEngineWith" not in result.console


def test_two_ppo_steps_train_the_critic_and_the_rollout_matches_the_actor(ppo_run):
    _, result = ppo_run
    assert sorted(result.metrics) == [1, 2], "verl printed no metrics for steps 1 and 2"
    for step, m in result.metrics.items():
        for key in ("critic/score/mean", "critic/vf_loss", "critic/values/mean", "actor/kl_loss", "actor/pg_loss",
                    "timing_s/step"):
            assert key in m and math.isfinite(m[key]), f"step {step}: {key} missing or not finite"
        # the weight sync by Bridge's export: the rollout's log-probs are the actor's (the gate's bound, 1e-5)
        assert m["training/rollout_probs_diff_max"] <= 1e-5, (step, m["training/rollout_probs_diff_max"])
    # the critic's update changed its values: step 2's value loss is not step 1's
    assert result.metrics[1]["critic/vf_loss"] != result.metrics[2]["critic/vf_loss"]
    # the actor starts as the reference and moved away from it with step 1's update (the optimizer ran on dev's model)
    assert result.metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert result.metrics[2]["actor/kl_loss"] > 1e-4
    assert result.peak_rss_gb < RSS_LIMIT_GB and result.wall_s < TIMEOUT_S
