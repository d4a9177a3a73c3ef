"""verl's own PPO trainer (main_ppo, v1, Ray) with the GRPO recipe on CPU: tiny DS4 actor/ref at CP=2, 2 steps, no critic.

The real run: ``DS4_RL_RECIPE=grpo scripts/run_ds4_proxy_ppo_cpu.sh`` (recipe ``ds4_proxy_grpo_cpu``: the
GPU GRPO recipe's knobs, ``algorithm.adv_estimator=grpo``, ``rollout.n > 1``, ``critic.enable=false``, KL loss
to the reference model) with 4 prompts x 2 responses, under the same guard as the PPO test
(:func:`verl_ds4.rollout.cpu_ppo_run.run_guarded`: a wall-clock limit and a 12 GB limit on the RSS of the
whole process tree). Negative controls: the PPO run of ``test_cpu_ppo_on_cpu.py`` reports a critic where this
one must not, and the launcher refuses GRPO with one response per prompt before starting anything.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from verl_ds4.testing.cpu_rl import REPO, run_cpu_rl_launcher

# The guard against a hang; a loaded shared machine may need more (VERL_DS4_CPU_RL_TIMEOUT_S).
TIMEOUT_S = float(os.environ.get("VERL_DS4_CPU_RL_TIMEOUT_S", "1200"))  # a hang guard: about 100-200 s a launch
RSS_LIMIT_GB = 12.0
ROLLOUT_N = 2
BATCH = 4


def test_launcher_refuses_grpo_with_one_response_per_prompt(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "DS4_RL_RECIPE": "grpo", "WORK_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh"), "actor_rollout_ref.rollout.n=1"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "GRPO needs actor_rollout_ref.rollout.n > 1" in proc.stderr
    assert not (tmp_path / "assets").exists(), "refused at start-up, before writing anything"
    # The control for this refusal is the run below: GRPO with n=2 starts and trains.
    env["DS4_RL_RECIPE"] = "reinforce"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "DS4_RL_RECIPE=reinforce: expected ppo or grpo" in proc.stderr
    # MINI_BATCH must tile BATCH (verl would train the remainder as a smaller update); the controls are
    # test_launcher_passes_mini_batch_to_verl (8 of 16) and the run below (the default, BATCH).
    for batch, mini in (("8", "3"), ("8", "0"), ("8", "x")):
        env.update(DS4_RL_RECIPE="ppo", BATCH=batch, MINI_BATCH=mini)
        proc = subprocess.run(["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh")], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"MINI_BATCH={mini}, BATCH=8: expected positive integers" in proc.stderr
        assert not (tmp_path / "assets").exists()


def test_launcher_passes_mini_batch_to_verl(tmp_path):
    """The command line the launcher builds, read through a stand-in interpreter that prints its arguments
    (nothing runs): MINI_BATCH is the actor's ppo_mini_batch_size (the critic's follows it in verl's config)."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "WORK_DIR": str(tmp_path / "work")}

    def command_line(**knobs):
        proc = subprocess.run(["bash", str(REPO / "scripts" / "run_ds4_proxy_ppo_cpu.sh")], env={**env, **knobs},
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.splitlines()

    args = command_line(BATCH="16", MINI_BATCH="8")
    assert "data.train_batch_size=16" in args and "actor_rollout_ref.actor.ppo_mini_batch_size=8" in args
    assert "data=" + str(tmp_path / "work" / "assets" / "data" / "train.parquet") + " (256 prompts), batch 16 (updates of 8)" \
        ", response <= 16 tokens, 3 steps" in args
    # the control: without MINI_BATCH, one update a step
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=16" in command_line(BATCH="16")


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("grpo")
    env = {"DS4_RL_RECIPE": "grpo", "STEPS": "2", "N_TRAIN": "32", "BATCH": str(BATCH), "RESPONSE_LENGTH": "8"}
    result = run_cpu_rl_launcher(work, env, timeout_s=TIMEOUT_S, rss_limit_gb=RSS_LIMIT_GB,
                                 args=[f"actor_rollout_ref.rollout.n={ROLLOUT_N}"])
    print(f"\nCPU GRPO: 2 steps in {result.wall_s:.0f} s, peak RSS {result.peak_rss_gb:.1f} GB")
    print(result.console)
    return work, result


def test_grpo_console_has_a_line_per_step_the_summary_and_the_reward_line(grpo_run):
    _, result = grpo_run
    lines = result.console.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("[verl-ds4] step ")] == ["1/2", "2/2"]
    assert any(line.startswith("[verl-ds4] result      the RL path ran: 2 GRPO steps (rollout, reward, group-relative")
               for line in lines), result.console
    assert any(line.startswith("[verl-ds4] reward: first 1 steps mean ") for line in lines), result.console
    # the summary table's mismatch columns (the PPO test's run ends in the gate's stop, without a summary)
    assert "lp_diff_max" in result.console and "k3_kl" in result.console
    assert "recipe ds4_proxy_grpo_cpu" in result.console


def test_grpo_runs_without_a_critic_with_group_advantages_and_kl(grpo_run):
    work, result = grpo_run
    assert sorted(result.metrics) == [1, 2], "verl printed no metrics for steps 1 and 2"
    for step, m in result.metrics.items():
        for key in ("critic/score/mean", "actor/kl_loss", "actor/pg_loss", "critic/advantages/mean", "timing_s/step"):
            assert key in m and math.isfinite(m[key]), f"step {step}: {key} missing or not finite"
        assert 0.0 <= m["critic/score/min"] <= m["critic/score/mean"] <= m["critic/score/max"] <= 1.0
        # verl-ds4's straggler ratios of the actor update (verl_ds4/engine/straggler.py), as verl's trainer logs them
        cp_ratio, worst = m["actor/perf/cp_straggler_ratio"], m["actor/perf/cp_straggler_ratio_max"]
        assert 1.0 <= cp_ratio <= worst and m["actor/perf/dp_straggler_ratio"] >= 1.0, (step, cp_ratio, worst)
        assert m["actor/perf/cp_straggler_ratio_batch_order"] == cp_ratio  # the recipe's cp_balance=null
        # No critic: verl reports no value loss and no values (the PPO run reports both).
        assert not any(k.startswith(("critic/vf_", "critic/values/", "timing_s/update_critic")) for k in m), sorted(m)
    assert "'adv_estimator': 'grpo'" in result.log, "the resolved config should show adv_estimator grpo"
    assert "'n': 2" in result.log, "the resolved config should show rollout.n=2"
    assert f"batch {BATCH} (updates of {BATCH})" in result.console  # MINI_BATCH's default: one update a step
    assert result.metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    # Each response is sampled with its own seed (verl_ds4/rollout/agent_loop.py), so a group's responses differ
    # and their group-relative advantages are not all 0. With verl's single_turn_agent every request of the v1
    # trainer is "det-0": one seed for all, identical responses in a group, and every advantage was exactly 0 on
    # every step (measured, 2026-12-02: no policy gradient at all). The seeded run is deterministic, so this is
    # one fixed outcome, not a chance.
    # (pg_loss itself may be 0 at step 1: on-policy it is minus the token mean of the advantages, which cancel
    # within a group when its responses are equally long.)
    for step, m in result.metrics.items():
        assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"], f"step {step}: all advantages 0"
    # fp32 actor and reference: step 1's advantages moved the actor away from the reference
    assert result.metrics[2]["actor/kl_loss"] > 1e-6, "step 1 had non-zero advantages, yet the actor did not move"
    # rollout and trainer agree on the log-probs after the weight sync (verl's mismatch metric)
    assert result.metrics[2]["training/rollout_probs_diff_max"] < 0.05
    assert "CPUMegatronEngineWithLMHead: contiguous CP layout (cp=2" in result.log
    assert "CPUMegatronEngineWithValueHead" not in result.log, "GRPO must not build a critic"
    step_dir = work / "checkpoints" / "global_step_2"
    assert (step_dir / "actor" / "model").is_dir() and not (step_dir / "critic").exists()
    assert result.peak_rss_gb < RSS_LIMIT_GB and result.wall_s < TIMEOUT_S
