"""The GRPO recipe's launcher on CPU (``DS4_RL_RECIPE=grpo scripts/run_ds4_proxy_ppo_cpu.sh``, recipe
``ds4_proxy_grpo_cpu``: the GPU GRPO recipe's knobs, ``algorithm.adv_estimator=grpo``, ``rollout.n > 1``,
``critic.enable=false``, KL loss to the reference model): what it passes to verl, and what it refuses before starting
anything (one response per prompt).

The suite's GRPO run itself (verl's own PPO trainer, main_ppo v1, with this recipe: tiny DS4 actor and reference at
CP=2, 4 prompts x 2 responses, no critic) is the two-node Ray run of ``tests/test_cluster_launchers_real_on_cpu.py``,
which also loses its worker node and resumes: it checks the group-relative advantages, the KL to the reference, that
no critic is built, and the console's summary (one launch instead of two: each costs CI about two minutes). The
control: the PPO runs of ``test_cpu_ppo_on_cpu.py`` report a critic where GRPO must not.
"""

from __future__ import annotations

import subprocess
import sys

from verl_ds4.testing.cpu_rl import REPO


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
    # test_launcher_passes_mini_batch_to_verl (8 of 16) and the two-node GRPO run (the default, BATCH).
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
