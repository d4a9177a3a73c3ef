"""verl's own PPO trainer (main_ppo, v1, Ray) on CPU: tiny DS4 actor/ref/critic (the full model, MODEL=ds4) at CP=2, 2 steps.

The real run: ``scripts/run_ds4_proxy_ppo_cpu.sh`` (the README's laptop launcher) with STEPS=2, under
:func:`verl_ds4.rollout.cpu_ppo_run.run_guarded`: a 6-minute wall-clock limit (verl's TransferQueue waits
forever instead of failing when Ray lacks logical CPUs) and a 12 GB limit on the RSS of the whole process
tree. Everything in it is real: Ray, TransferQueue, verl's agent loop and trainer, the Megatron engines
with the full tiny DS4, the ``cpu_demo`` rollout, the rule reward, GAE, the checkpoint. The launcher's
console is quiet: the checks read verl's metrics from the full log it names (``WORK_DIR/logs/``), and
check that the console itself shows one line per step and the summary.
"""

from __future__ import annotations

import math
import sys

import pytest

from verl_ds4.rollout.cpu_ppo_run import CPUPPORunError, parse_step_metrics, run_guarded, summary_table
from verl_ds4.testing.cpu_rl import run_cpu_rl_launcher
TIMEOUT_S = 360
RSS_LIMIT_GB = 12.0


def test_guard_turns_a_hang_into_a_clear_error(tmp_path):
    with pytest.raises(CPUPPORunError, match=r"no result after 2 s; killed") as err:
        run_guarded(["bash", "-c", "echo starting; sleep 120"], tmp_path / "log", timeout_s=2, rss_limit_gb=4, poll_s=0.2)
    assert "num_data_storage_units=1" in str(err.value) and "starting" in str(err.value)


def test_guard_reports_a_failing_run_with_its_log(tmp_path):
    with pytest.raises(CPUPPORunError, match="exited with status 3") as err:
        run_guarded(["bash", "-c", "echo boom >&2; exit 3"], tmp_path / "log", timeout_s=30, rss_limit_gb=4, poll_s=0.2)
    assert "boom" in str(err.value)


def test_guard_enforces_the_memory_limit(tmp_path):
    code = "import time; b = bytearray(300 * 2**20); time.sleep(30)"
    with pytest.raises(CPUPPORunError, match="above the 0.1 GB limit"):
        run_guarded([sys.executable, "-c", code], tmp_path / "log", timeout_s=60, rss_limit_gb=0.1, poll_s=0.2)


def test_parse_step_metrics_reads_verls_console_lines():
    text = (
        "\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m step:1 - critic/vf_loss:0.15 - actor/kl_loss:0.0 - timing_s/step:35.9\n"
        "noise step:x - a:b\n"
        "(TaskRunnerV1 pid=1) step:2 - critic/vf_loss:0.12 - actor/kl_loss:0.25 - critic/score/mean:0.06\n"
    )
    metrics = parse_step_metrics(text)
    assert metrics == {
        1: {"critic/vf_loss": 0.15, "actor/kl_loss": 0.0, "timing_s/step": 35.9},
        2: {"critic/vf_loss": 0.12, "actor/kl_loss": 0.25, "critic/score/mean": 0.06},
    }
    table = summary_table(metrics)
    assert table.splitlines()[0].split()[:4] == ["step", "reward", "value_loss", "kl(actor|ref)"]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("ppo")
    result = run_cpu_rl_launcher(work, {"STEPS": "2", "N_TRAIN": "64"}, timeout_s=TIMEOUT_S, rss_limit_gb=RSS_LIMIT_GB)
    print(f"\nCPU PPO: 2 steps in {result.wall_s:.0f} s, peak RSS {result.peak_rss_gb:.1f} GB")
    print(result.console)
    return work, result


def test_the_console_is_quiet_with_a_line_per_step_and_the_summary(ppo_run):
    _, result = ppo_run
    lines = result.console.splitlines()
    assert max(map(len, lines)) <= 300 and len(lines) < 60, result.console
    assert [line.split()[2] for line in lines if line.startswith("[verl-ds4] step ")] == ["1/2", "2/2"]
    assert any(line.startswith("[verl-ds4] result      the RL path ran: 2 PPO steps") for line in lines)
    assert "step:1 - " not in result.console and "step:1 - " in result.log  # verl's own lines: log only
    assert "UserWarning" not in result.console and "UserWarning" in result.log


def test_two_ppo_steps_report_reward_value_loss_kl_and_time(ppo_run):
    _, result = ppo_run
    assert sorted(result.metrics) == [1, 2], "verl printed no metrics for steps 1 and 2"
    for step, m in result.metrics.items():
        for key in ("critic/score/mean", "critic/vf_loss", "actor/kl_loss", "actor/pg_loss", "timing_s/step"):
            assert key in m and math.isfinite(m[key]), f"step {step}: {key} missing or not finite"
        assert 0.0 <= m["critic/score/min"] <= m["critic/score/mean"] <= m["critic/score/max"] <= 1.0
        assert m["critic/vf_loss"] > 0 and m["timing_s/step"] > 0
    # The reference model is the initial actor: KL is 0 before the first update and positive after it.
    assert result.metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert result.metrics[2]["actor/kl_loss"] > 1e-4
    assert result.peak_rss_gb < RSS_LIMIT_GB and result.wall_s < TIMEOUT_S


def test_rollout_samples_with_the_updated_actor_weights(ppo_run):
    _, result = ppo_run
    # verl compares the rollout's log-probs with the actor's recomputation: after the first update
    # (the actor moved away from the reference, see the KL) they still agree only if the weights synced.
    m = result.metrics[2]
    assert m["actor/kl_loss"] > 1e-4
    assert m["training/rollout_probs_diff_max"] < 0.05
    assert m["training/rollout_actor_probs_pearson_corr"] > 0.99


def test_engines_ran_contiguous_cp2_and_saved_a_checkpoint(ppo_run):
    work, result = ppo_run
    for engine in ("CPUMegatronEngineWithLMHead", "CPUMegatronEngineWithValueHead"):
        assert f"{engine}: contiguous CP layout (cp=2" in result.log
    assert "cpu_demo rollout server 0 ready" in result.log
    step_dir = work / "checkpoints" / "global_step_2"
    for role in ("actor", "critic"):
        assert (step_dir / role / "model").is_dir(), f"no {role} checkpoint in {step_dir}"
    assert (work / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
