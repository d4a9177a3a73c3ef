"""The CPU launchers' quiet console (verl_ds4.cpu.console, the PPO view in verl_ds4.rollout.cpu_ppo_run).

Fast checks (no torchrun): the summary parser says "worked" only when the loss falls (negative
controls: a flat loss, a NaN, a run that stopped early), the runner tees every byte to the log and
shows only our lines (tqdm's carriage-return redraws included), a failing command prints the log's
tail and its path and passes its exit status on, ``verbose`` passes everything through, the loss
plot is written (and skipped with a note without matplotlib).

Real runs of ``scripts/run_ds4_proxy_sft_cpu.sh`` (torchrun, 2 CPU processes, the tiny DS4):
4 quiet steps; the same command again with VERBOSE=1 and STEPS=6 resumes from step 4 and shows
verl's full output; a bad Hydra override fails with the log's tail on the console.
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ds4.cpu.console import SFTConsole, log_tail, parse_progress, plot_losses, run_quiet, sft_summary_lines, summarize_sft
from verl_ds4.cpu.progress import progress_line
from verl_ds4.cpu.sft_run import free_port, parse_losses
from verl_ds4.cpu.console_ppo import plot_rl_metrics, reward_trend_line
from verl_ds4.rollout.cpu_ppo_run import PPOConsole, ppo_summary_lines

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "scripts" / "run_ds4_proxy_sft_cpu.sh"
RUN_TIMEOUT_S = 400


def _log(losses, start=1, tokens=800) -> str:
    lines = []
    for i, loss in enumerate(losses):
        step = start + i
        lines.append(f"Epoch 1/9: {step}%|  | \r" + progress_line(step, loss, tokens, 0.5, 0.5 * (i + 1)))
        lines.append(f"step:{step} - train/loss:{loss} - train/global_tokens:{tokens}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ the summary parser


def test_summary_of_a_falling_loss_says_training_worked():
    s = summarize_sft(_log([5.0 - 0.05 * i for i in range(40)]) + "Saving checkpoint to: ck/global_step_40\n", 40)
    assert s.worked and "training worked" in s.verdict, s.verdict
    assert s.window == 20 and s.first_mean == pytest.approx(4.525) and s.last_mean == pytest.approx(3.525)
    assert s.rel_change == pytest.approx(-1 / 4.525)
    assert s.checkpoint == "ck/global_step_40" and s.resumed_from is None
    assert s.tokens_per_s == pytest.approx(1600)  # 800 tokens per 0.5 s step


def test_summary_of_a_flat_loss_says_not_learning():  # negative control
    s = summarize_sft(_log([3.0, 3.1] * 20), 40)
    assert not s.worked and s.verdict.startswith("NOT LEARNING"), s.verdict
    assert "(+0.0% from the first to the last 20-step mean)" in s.verdict, s.verdict


def test_summary_reports_a_nan_loss_and_an_early_stop():  # negative controls
    s = summarize_sft(_log([5.0, 4.0, float("nan"), 3.0]), 4)
    assert not s.worked and s.verdict == "TRAINING FAILED: the loss is not finite at step 3"
    s = summarize_sft(_log([5.0 - 0.1 * i for i in range(10)]), 80)
    assert not s.worked and s.verdict.startswith("INCOMPLETE: the run stopped at step 10 of 80")
    s = summarize_sft("nothing here\n", 10)
    assert not s.worked and s.verdict.startswith("NO TRAINING STEPS")


def test_summary_of_a_resumed_run_names_the_step_and_judges_the_whole_curve():
    text = "Found latest checkpoint: ck/global_step_4 (step 4)\n" + _log([2.0, 1.9], start=5)
    earlier = [(step, 5.0 - 0.5 * step) for step in range(1, 7)]  # steps 5, 6 of the old run are replaced
    s = summarize_sft(text, 6, earlier=earlier)
    assert s.resumed_from == 4 and s.steps == [5, 6] and s.curve_steps == [1, 2, 3, 4, 5, 6]
    assert s.curve_losses[:4] == [4.5, 4.0, 3.5, 3.0] and s.curve_losses[4:] == [2.0, 1.9]
    assert s.worked and s.window == 3
    alone = summarize_sft(text, 6)  # without the earlier logs: only this run's two steps
    assert alone.resumed_from == 4 and alone.curve_steps == [5, 6] and alone.window == 1
    # Resuming a finished run: verl trains one step past STEPS; the summary says so.
    done = summarize_sft("Found latest checkpoint: ck/global_step_6 (step 6)\n" + _log([1.8], start=7), 6,
                         earlier=earlier)
    text = "\n".join(sft_summary_lines(done))
    assert "resumed from step 6" in text and "verl's sft_trainer still trains one more step" in text
    assert "still trains one more step" not in "\n".join(sft_summary_lines(s))


# ------------------------------------------------------------------------------------ the runner


NOISY = r"""
import sys, time
print("W" * 7000)                       # a TransformerConfig dump
sys.stderr.write("UserWarning: Apex is not installed\n")
for step in (1, 2, 3, 4):
    sys.stderr.write("\rEpoch 1/1:  %d%%|##| " % (25 * step))
    sys.stderr.write("      " + PROGRESS[step] + "\n")
    print("step:%d - train/loss:%.1f - train/global_tokens:100" % (step, 5 - step))
    sys.stdout.flush(); sys.stderr.flush()
print("Saving checkpoint to: ck/global_step_4")
sys.exit(CODE)
"""


def _noisy_cmd(code: int = 0) -> list[str]:
    progress = {s: progress_line(s, 5.0 - s, 100, 0.1, 0.1 * s) for s in (1, 2, 3, 4)}
    return [sys.executable, "-c", f"PROGRESS = {progress!r}; CODE = {code}\n" + NOISY]


def test_quiet_console_shows_our_lines_and_the_log_keeps_everything(tmp_path):
    out = io.StringIO()
    view = SFTConsole(tmp_path, 4, facts=[("model", "fake")], every=2)
    rc = run_quiet(_noisy_cmd(), tmp_path / "logs" / "x.log", view, out=out)
    console = out.getvalue()
    assert rc == 0
    lines = console.splitlines()
    assert max(map(len, lines)) <= 300, console
    assert "W" * 100 not in console and "UserWarning" not in console and "step:1 -" not in console
    steps = [line.split()[2] for line in lines if line.startswith("[verl-ds4] step ")]
    assert steps == ["1/4", "2/4", "4/4"], console  # first, every 2nd, last
    assert "| ETA " in console and "[verl-ds4] model       fake" in console
    assert "[verl-ds4] result      training worked" in console
    assert f"[verl-ds4] full log    {tmp_path / 'logs' / 'x.log'}" in console
    log = (tmp_path / "logs" / "x.log").read_text()
    assert "W" * 7000 in log and "UserWarning" in log and parse_losses(log) == {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0}
    assert [p.step for p in parse_progress(log)] == [1, 2, 3, 4]


def test_verbose_console_passes_everything_through(tmp_path):
    out = io.StringIO()
    rc = run_quiet(_noisy_cmd(), tmp_path / "x.log", SFTConsole(tmp_path, 4), out=out, verbose=True)
    assert rc == 0
    console = out.getvalue()
    assert "W" * 7000 in console and "UserWarning" in console and "step:3 - train/loss:2.0" in console
    assert "[verl-ds4] result      training worked" in console


def test_failing_command_prints_the_log_tail_and_path_and_its_status(tmp_path):
    out = io.StringIO()
    rc = run_quiet(_noisy_cmd(code=3), tmp_path / "x.log", SFTConsole(tmp_path, 4), out=out)
    console = out.getvalue()
    assert rc == 3
    assert "exited with status 3" in console and "Saving checkpoint to: ck/global_step_4" in console
    assert f"FAILED (exit 3); full log: {tmp_path / 'x.log'}" in console
    assert "result " not in console  # no success summary for a failed run
    assert max(map(len, console.splitlines())) < 1100  # the 7000-character line is cut in the tail
    assert "known cause" not in console  # an ordinary failure gets no hint (the control for the next test)


def test_a_port_race_failure_names_its_known_cause(tmp_path):
    """torch's EADDRINUSE at init_process_group (verl's free-port race) is named as such: run it again."""
    error = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
             "address. port: 42193, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    cmd = [sys.executable, "-c", f"import sys; print({error!r}); print('noise\\n' * 100); sys.exit(1)"]
    out = io.StringIO()
    assert run_quiet(cmd, tmp_path / "x.log", SFTConsole(tmp_path, 4), out=out) == 1
    console = out.getvalue()
    hint = [line for line in console.splitlines() if "known cause" in line]
    assert len(hint) == 1 and "MASTER_PORT" in hint[0] and "verl #5889" in hint[0] and "run it again" in hint[0], console
    assert console.rstrip().endswith(f"FAILED (exit 1); full log: {tmp_path / 'x.log'}")


def test_failure_tail_ends_before_torchruns_own_report(tmp_path):
    log = tmp_path / "x.log"
    report = ["E1201 12:00:00.1 9 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
              "local_rank: 0 (pid: 5) of binary: python"] + ["torchrun boilerplate"] * 45
    log.write_text("\n".join([f"noise {i}" for i in range(100)] + ["ValueError: the real error"] + report) + "\n")
    tail = log_tail(log)
    assert len(tail) == 41 and tail[-2] == "ValueError: the real error" and tail[0] == "noise 61"
    assert tail[-1].startswith("(then torchrun's report: failed (exitcode: 1) local_rank: 0") and "46 lines" in tail[-1]
    log.write_text("\n".join(f"line {i}" for i in range(100)) + "\n")  # no torchrun report: the plain tail
    assert log_tail(log) == [f"line {i}" for i in range(60, 100)]


def test_loss_plot_and_its_skip_note(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    note = plot_losses([1, 2, 3], [3.0, 2.0, 1.5], tmp_path / "loss.png", resumed_from=2)
    assert note == str(tmp_path / "loss.png") and (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    note = plot_losses([1, 2], [3.0, 2.0], tmp_path / "none.png")
    assert note.startswith("no loss plot: matplotlib is not installed") and not (tmp_path / "none.png").exists()


def test_ppo_console_lines_and_summary(tmp_path):
    view = PPOConsole(tmp_path, 3)
    line = ("(TaskRunnerV1 pid=7) step:1 - critic/score/mean:0.05 - critic/vf_loss:0.12 - actor/kl_loss:0.0 "
            "- timing_s/step:30.0")
    [shown] = view.on_line(line)
    assert shown.startswith("[verl-ds4] step 1/3 | reward 0.05 | value_loss 0.12 | kl 0 | step 30s")
    assert shown.endswith("ETA 1m00s") and view.on_line(line) == []  # each step once
    assert view.on_line("(WorkerDict pid=9) [verl-ds4] step 4 | loss 1.0 | 9 tok/s | elapsed 1.0s") == []
    metrics = {1: {"critic/vf_loss": 0.1}, 2: {"critic/vf_loss": 0.2}}
    done = "\n".join(ppo_summary_lines(metrics, 2))
    assert "the RL path ran: 2 PPO steps" in done and "value_loss" in done
    assert "INCOMPLETE: the run stopped at PPO step 2 of 3" in "\n".join(ppo_summary_lines(metrics, 3))
    assert "NOT FINITE: critic/vf_loss" in "\n".join(ppo_summary_lines({1: {"critic/vf_loss": math.nan}}, 1))


def _rewards(values):
    return {step: {"critic/score/mean": value} for step, value in enumerate(values, start=1)}


def test_reward_trend_line_and_learning_verdict():
    rising = _rewards([0.1, 0.1, 0.2, 0.2, 0.2] + [0.3] * 10 + [0.5, 0.6, 0.6, 0.7, 0.6])
    assert reward_trend_line(rising) == "reward: first 5 steps mean 0.160, last 5 steps mean 0.600"
    assert reward_trend_line(_rewards([0.2, 0.4, 0.3])) == "reward: first 1 steps mean 0.200, last 1 steps mean 0.300"
    assert reward_trend_line(_rewards([0.2])).startswith("reward: fewer than 2 steps")
    learned = "\n".join(ppo_summary_lines(rising, 20, reward_rise=0.3, algo="grpo"))
    assert "LEARNED: the mean reward rose by 0.440 (>= 0.3) in 20 GRPO steps" in learned
    assert "[verl-ds4] reward: first 5 steps mean 0.160, last 5 steps mean 0.600" in learned
    flat = _rewards([0.3, 0.35] * 10)  # negative control: noise, no trend
    assert "DID NOT LEARN ENOUGH: the mean reward rose by 0.010 in 20 PPO steps, expected >= 0.3" in "\n".join(
        ppo_summary_lines(flat, 20, reward_rise=0.3))
    # without a bar the verdict is about the RL path, and says where the model came from
    assert "all metrics finite; started from the given checkpoint" in "\n".join(
        ppo_summary_lines(flat, 20, from_checkpoint=True))
    assert "(rollout, reward, group-relative advantages, actor update" in "\n".join(ppo_summary_lines(flat, 20, algo="grpo"))


def test_rl_metrics_plot_says_what_was_not_reported(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    texts = []
    real_text = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda self, *a, **k: texts.append(a[2]) or real_text(self, *a, **k))
    grpo = {1: {"critic/score/mean": 0.1, "actor/kl_loss": 0.0, "training/rollout_probs_diff_max": 0.01},
            2: {"critic/score/mean": 0.2, "actor/kl_loss": 0.01, "training/rollout_probs_diff_max": 0.02}}
    note = plot_rl_metrics(grpo, tmp_path / "rl.png")
    assert note == str(tmp_path / "rl.png") and (tmp_path / "rl.png").read_bytes()[:4] == b"\x89PNG"
    assert texts == ["not reported"]  # GRPO has no value loss; reward, KL and the mismatch are drawn
    texts.clear()
    plot_rl_metrics({1: {"critic/score/mean": 0.1}}, tmp_path / "rl2.png")
    assert texts == ["not reported"] * 3  # the control: a run without KL, value loss and mismatch metrics
    # With the mismatch gate's figure reported too, that one is plotted (verl's probability difference is not).
    titles = []
    real_title = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: titles.append(t) or real_title(self, t, *a, **k))
    gated = {s: dict(m, **{"training/rollout_log_probs_diff_max": 1e-6}) for s, m in grpo.items()}
    plot_rl_metrics(gated, tmp_path / "rl3.png")
    assert titles[-1].endswith("rollout_log_probs_diff_max"), titles
    plot_rl_metrics(grpo, tmp_path / "rl4.png")  # the control: without it, verl's figure
    assert titles[-1].endswith("rollout_probs_diff_max") and "log_probs" not in titles[-1], titles
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_rl_metrics(grpo, tmp_path / "none.png").startswith("no plot: matplotlib is not installed")


# ---------------------------------------------------------------------------- real launcher runs


def _launch(work: Path, *args: str, **knobs: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, WORK_DIR=str(work), N_TRAIN="64", MASTER_PORT=str(free_port()),
               **knobs)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(["bash", str(LAUNCHER), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def quiet_then_verbose_resume(tmp_path_factory):
    work = tmp_path_factory.mktemp("sft")
    first = _launch(work, STEPS="4", SAVE_FREQ="2")
    assert first.returncode == 0, first.stdout + first.stderr
    second = _launch(work, STEPS="6", SAVE_FREQ="2", VERBOSE="1")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    return work, first, second


def test_quiet_run_shows_facts_progress_and_summary(quiet_then_verbose_resume):
    work, first, _ = quiet_then_verbose_resume
    console = first.stdout + first.stderr
    lines = console.splitlines()
    assert max(map(len, lines)) <= 300 and len(lines) < 40, console
    assert "TF config" not in console and "UserWarning" not in console and "step:1 -" not in console
    assert "[verl-ds4] CP layout   contiguous (cp=2" in console
    assert [line.split()[2] for line in lines if line.startswith("[verl-ds4] step ")] == ["1/4", "2/4", "3/4", "4/4"]
    assert "[verl-ds4] result      training worked" in console
    assert f"[verl-ds4] checkpoint  {work}/checkpoints/global_step_4" in console
    assert f"[verl-ds4] loss plot   {work}/loss.png" in console and (work / "loss.png").is_file()
    [log_line] = [line for line in lines if line.startswith("[verl-ds4] full log")]
    log = Path(log_line.split()[-1])
    assert log.parent == work / "logs" and "TF config" in log.read_text()
    assert sorted(parse_losses(log.read_text())) == [1, 2, 3, 4]  # verl's own lines, in the log


def test_verbose_resumed_run_shows_everything_and_the_resume_step(quiet_then_verbose_resume):
    work, _, second = quiet_then_verbose_resume
    console = second.stdout + second.stderr
    assert "TF config" in console and "step:5 - " in console and "UserWarning" in console  # verl's full output
    assert "[verl-ds4] resume      from step 4" in console
    assert "[verl-ds4] steps       2 in this run (steps 5-6 of 6); resumed from step 4" in console
    assert "(steps 1-6: the earlier runs' logs up to step 4, then this run)" in console
    assert f"[verl-ds4] checkpoint  {work}/checkpoints/global_step_6" in console


def test_bad_override_fails_with_the_log_tail_and_path(tmp_path):
    # A misspelt key no longer reaches torchrun (the launcher's pre-check, tests/test_override_keys_on_cpu.py):
    # a model path that does not exist composes and fails in the workers.
    run = _launch(tmp_path, f"model.path={tmp_path / 'no_such_knob'}", STEPS="2")
    console = run.stdout + run.stderr
    assert run.returncode != 0, console
    assert "last lines of the full log (up to 40):" in console, console
    assert "    Error in call to target 'verl.workers.config.model.HFModelConfig':" in console, console  # the workers' error, not torchrun's
    assert "(then torchrun's report: failed (exitcode: 1)" in console and "ChildFailedError" not in console
    [fail_line] = [line for line in console.splitlines() if line.startswith("[verl-ds4] FAILED (exit")]
    log = Path(fail_line.split()[-1])
    assert log.parent == tmp_path / "logs" and "no_such_knob" in log.read_text()
    assert "result " not in console
