"""Automatic restart (issue 44): :mod:`verl_ds4.recipes.supervise` around a stand-in trainer.

The stand-in (:mod:`verl_ds4.testing.standin_trainer`) is a real process that resumes like a launcher, prints
verl's per-step lines and saves checkpoints with manifests; its faults are real signals (SIGKILL of itself,
of a child "rank") and real exceptions. Each rule has its negative control: the same run with
``MAX_RESTARTS=0`` stops, a different failure is restarted, progress is restarted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_ds4.recipes import supervise as sv
from verl_ds4.testing.standin_trainer import loss_at

REPO = Path(__file__).resolve().parents[1]
STEP_LOSS = re.compile(r"^step:(\d+) - train/loss:([0-9.]+)", re.M)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RESUME_MODE", None)
    return env


def _supervised(tmp: Path, budget, *trainer_args, extra=(), timeout=120, env=None):
    """Run the supervisor around the stand-in; (exit status, output, [(seconds since start, line)])."""
    ckpt = tmp / "ckpt"
    cmd = [sys.executable, "-m", "verl_ds4.recipes.supervise", "--max-restarts", str(budget), "--ckpt-dir", str(ckpt),
           *extra, "--", sys.executable, "-m", "verl_ds4.testing.standin_trainer", "--ckpt-dir", str(ckpt),
           *map(str, trainer_args)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env={**_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)
    timed = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    proc.wait(timeout=timeout)
    return proc.returncode, "\n".join(line for _, line in timed), timed


def _attempts(out: str) -> int:
    return out.count("stand-in trainer: pid")


def test_a_trainer_killed_by_sigkill_is_restarted_from_the_newest_intact_checkpoint_and_finishes(tmp_path):
    rc, out, timed = _supervised(tmp_path, 3, "--steps", 8, "--save-freq", 2, "--kill-at", 6, "--once",
                                 tmp_path / "once")
    assert rc == 0, out
    assert "MAX_RESTARTS=3" in out.splitlines()[0]
    assert ("restart     1 of 3: attempt 1 failed at step 6 (killed by SIGKILL); starting again from step 4 "
            "(the newest intact checkpoint in") in out and "resume_mode=auto; 2 tries left" in out, out
    assert "resume_mode=auto, from step 4, DS4_RESTART=1" in out and _attempts(out) == 2
    # Every step's last loss is the uninterrupted run's; step 5 was trained again after the resume from step 4.
    seen = [(int(s), float(v)) for s, v in STEP_LOSS.findall(out)]
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert dict(seen) == {s: loss_at(s) for s in range(1, 9)}
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "8"
    died = next(t for t, line in timed if line.startswith("step:5"))
    again = [t for t, line in timed if line.startswith("stand-in trainer: pid")][1]
    print(f"\nrestart latency (last step printed -> the new attempt's first line, Python start included): "
          f"{again - died:.2f} s")
    assert again - died < 30

    # Negative control: no budget, the same fault ends the run.
    rc, out, _ = _supervised(tmp_path / "zero", 0, "--steps", 8, "--kill-at", 6, "--once", tmp_path / "zero_once")
    assert rc == 128 + signal.SIGKILL and _attempts(out) == 1, out
    assert "not restarted: attempt 1 failed at step 6 (killed by SIGKILL), and no restart is left" in out


def test_a_rank_killed_under_a_torchrun_like_parent_is_restarted(tmp_path):
    rc, out, _ = _supervised(tmp_path, 2, "--steps", 6, "--kill-rank-at", 4, "--once", tmp_path / "once")
    assert rc == 0 and _attempts(out) == 2, out
    assert "attempt 1 failed at step 4 (a rank was killed by SIGKILL (torchrun: exitcode -9))" in out
    assert "starting again from step 2" in out


def test_a_refusal_or_a_config_error_before_step_1_is_not_restarted(tmp_path):
    rc, out, _ = _supervised(tmp_path, 3, "--refuse")
    assert rc == 2 and _attempts(out) == 0 and "restart     " not in out, out
    assert ("not restarted: attempt 1 failed at start-up, before its first training step (trainer.total_training_steps=-1: "
            "expected a positive integer (a stand-in refusal)): a config error or a refusal") in out
    rc, out, _ = _supervised(tmp_path / "raise", 3, "--raise-at", 1)
    assert rc == 1 and _attempts(out) == 1, out
    assert "before its first training step (RuntimeError: stand-in fault at step 1): a config error" in out
    # Negative control: killed by a signal before step 1 is a lost process, not a config error: restarted.
    rc, out, _ = _supervised(tmp_path / "kill", 3, "--steps", 3, "--kill-at", 1, "--once", tmp_path / "once")
    assert rc == 0 and _attempts(out) == 2 and "attempt 1 failed at step 1 (killed by SIGKILL)" in out, out


def test_the_same_step_failing_the_same_way_twice_stops(tmp_path):
    rc, out, _ = _supervised(tmp_path, 5, "--steps", 8, "--raise-at", 5)
    assert rc == 1 and _attempts(out) == 2, out
    assert ("not restarted: attempt 2 failed at step 5 the same way as attempt 1 (RuntimeError: stand-in fault "
            "at step 5)") in out


def test_a_run_started_without_auto_in_a_folder_of_an_earlier_run_is_not_restarted(tmp_path):
    from verl_ds4.testing.standin_trainer import _save

    old = tmp_path / "old" / "ckpt"
    old.mkdir(parents=True)
    _save(old, 50)  # an earlier run's intact checkpoint: resume_mode=auto would pick it
    disable = {"RESUME_MODE": "disable"}
    rc, out, _ = _supervised(tmp_path / "old", 3, "--steps", 6, "--kill-at", 4, "--once", tmp_path / "once1",
                             extra=["--resume-mode", "disable"], env=disable)
    assert rc == 128 + signal.SIGKILL and _attempts(out) == 1, out
    assert "it started with RESUME_MODE=disable in" in out and "already held checkpoints of an earlier run" in out
    # Control: a fresh folder; the restart resumes this run's own step 2 with resume_mode=auto.
    rc, out, _ = _supervised(tmp_path / "new", 3, "--steps", 6, "--kill-at", 4, "--once", tmp_path / "once2",
                             extra=["--resume-mode", "disable"], env=disable)
    assert rc == 0 and _attempts(out) == 2 and "resume_mode=auto, from step 2, DS4_RESTART=1" in out, out


def test_a_rank_killed_by_a_signal_is_named_before_the_sigterm_that_stopped_the_others():
    # srun (or torchrun) stops the other tasks with SIGTERM once one fails: its exit status 143 says only that.
    node0 = ["torch.distributed.elastic.multiprocessing.api.SignalException: Process 17 got signal: 15",
             "traceback : Signal 15 (SIGTERM) received by PID 17"]
    node1 = ["(then torchrun's report: failed (exitcode: -9) local_rank: 0 (pid: 18533) of binary: python; 40 lines)"]
    assert sv.failure_reason(143, node0 + node1) == ("a rank was killed by SIGKILL (torchrun: exitcode -9)", "SIGKILL")
    assert sv.failure_reason(143, node1 + node0) == ("a rank was killed by SIGKILL (torchrun: exitcode -9)", "SIGKILL")
    # SIGTERM alone is how srun and torchrun stop the others, not a lost process: the error printed is the reason
    # (a launcher's refusal on one node, the other node's task terminated by srun), and no signal counts.
    refusal = ["[verl-ds4] FAILED: the overrides do not compose with verl's sft_trainer_engine config (Hydra's error)",
               "    Could not override 'trainer.no_such_knob'."]
    assert sv.failure_reason(143, node0[:1] + refusal) == (
        "the overrides do not compose with verl's sft_trainer_engine config (Hydra's error)", None)
    assert sv.failure_reason(143, node0[1:]) == ("stopped by SIGTERM (exit status 143)", None)
    assert sv.failure_reason(-15, []) == ("stopped by SIGTERM (exit status -15)", None)
    # Controls: a fault signal counts, by exit status or by the report line; a Python error is named.
    assert sv.failure_reason(137, []) == ("killed by SIGKILL (exit status 137)", "SIGKILL")
    assert sv.failure_reason(1, ["traceback : Signal 11 (SIGSEGV) received by PID 9"]) == (
        "a process was killed by SIGSEGV", "SIGSEGV")
    assert sv.failure_reason(1, ["ValueError: bad"]) == ("ValueError: bad", None)


def _attempt(n, start, last, reason="RuntimeError: x", sig=None, rc=1):
    return sv.Attempt(n, start, rc, last, reason, sig)


def test_decide_rules_and_their_controls():
    # No intact checkpoint progress: two attempts in a row from step 4, no newer checkpoint.
    history = [_attempt(1, 4, 6, "killed by SIGKILL", "SIGKILL"), _attempt(2, 4, 5, "RuntimeError: y")]
    retry, why = sv.decide(history, 4, None, 3)
    assert not retry and "no intact checkpoint progress" in why and "both started from step 4" in why
    assert sv.decide(history, 6, None, 3)[0]  # control: a newer intact checkpoint: restarted
    assert sv.decide(history, None, None, 3, known=False)[0]  # no folder known (Slurm in a container): no such rule
    # The same way twice, pids and ports aside.
    same = [_attempt(1, None, 3, "a rank was killed by SIGKILL (pid 1234)", "SIGKILL"),
            _attempt(2, 2, 3, "a rank was killed by SIGKILL (pid 5678)", "SIGKILL")]
    assert "the same way as attempt 1" in sv.decide(same, 2, None, 3)[1]
    assert sv.decide([same[0], _attempt(2, 2, 4, "a rank was killed by SIGKILL", "SIGKILL")], 4, None, 3)[0]
    # Checkpoints, none intact.
    retry, why = sv.decide([_attempt(1, None, 3, sig="SIGKILL")], None, "DIR holds checkpoints but none is intact", 3)
    assert not retry and "no checkpoint to restart from: DIR holds checkpoints but none is intact" in why


def test_the_budget_runs_out(tmp_path):
    rc, out, _ = _supervised(tmp_path, 2, "--steps", 20, "--save-freq", 1, "--kill-every", 2)
    assert rc == 128 + signal.SIGKILL and _attempts(out) == 3, out
    assert "restart     2 of 2:" in out and "0 tries left" in out
    assert "not restarted: attempt 3 failed at step 7 (killed by SIGKILL), and no restart is left" in out


@pytest.mark.parametrize("bad", ["-1", "three", "", "1.5", "2x"])
def test_a_bad_max_restarts_is_refused_at_start_up(bad, tmp_path):
    cmd = [sys.executable, "-m", "verl_ds4.recipes.supervise", "--max-restarts", bad, "--", "false"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and f"MAX_RESTARTS={bad!r}: expected a non-negative integer" in proc.stderr
    assert proc.stdout == ""  # nothing ran


@pytest.mark.parametrize("override", ["trainer.resume_mode=disable", "+trainer.resume_mode=resume_path",
                                      "trainer.resume_from_path=/ckpt/global_step_4"])
def test_a_resume_override_a_restart_could_not_replace_is_refused_at_start_up(override, tmp_path):
    cmd = [sys.executable, "-m", "verl_ds4.recipes.supervise", "--max-restarts", "3", "--", "bash", "x.sh", override]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and f"verl-ds4: {override} with MAX_RESTARTS=3: a restart resumes" in proc.stderr
    # Controls: with no budget, or resume_mode=auto, nothing to refuse.
    sv.check_overrides(["bash", "x.sh", override], 0)
    sv.check_overrides(["bash", "x.sh", "trainer.resume_mode=auto", "trainer.resume_from_path=null"], 3)


@pytest.mark.parametrize("good", ["0", "3", "12"])
def test_a_good_max_restarts_is_accepted(good):
    assert sv.parse_budget(good) == int(good)


def test_a_checkpoint_folder_that_cannot_take_a_checkpoint_is_refused(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(sv.SuperviseError, match=r"the checkpoint folder .*a_file/ckpt is not writable"):
        sv.check_ckpt_dir(blocker / "ckpt")
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(sv.SuperviseError, match="is not writable"):
            sv.check_ckpt_dir(locked)
    ok = tmp_path / "ok"
    assert "writable" in sv.check_ckpt_dir(ok)  # control: created and accepted
    with pytest.raises(sv.SuperviseError, match=r"MiB free, less than one more checkpoint needs \(\d+ MiB, the least"):
        sv.check_ckpt_dir(ok, min_free=1 << 62)
    # Full: less room than the newest checkpoint's size.
    (ok / "global_step_3").mkdir()
    (ok / "global_step_3" / "model.pt").write_bytes(b"\0" * (3 << 20))
    usage = sv.shutil.disk_usage(ok)
    monkeypatch.setattr(sv.shutil, "disk_usage", lambda _p: usage._replace(free=2 << 20))
    with pytest.raises(sv.SuperviseError, match=r"has 2 MiB free, less than one more checkpoint needs \(3 MiB, the size "
                                                r"of global_step_3\): free space there"):
        sv.check_ckpt_dir(ok, min_free=1 << 20)
    monkeypatch.setattr(sv.shutil, "disk_usage", lambda _p: usage._replace(free=4 << 20))
    assert "writable" in sv.check_ckpt_dir(ok, min_free=1 << 20)  # control


def _requeue_cmd(ckpt: Path, state: Path) -> list[str]:
    return [sys.executable, "-m", "verl_ds4.recipes.supervise", "--max-restarts", "2", "--ckpt-dir", str(ckpt),
            "--state", str(state), "--requeue-signal", "USR1", "--", sys.executable, "-m",
            "verl_ds4.testing.standin_trainer", "--ckpt-dir", str(ckpt), "--steps", "6", "--save-freq", "2",
            "--step-s", "0.3", "--hold-after", "3"]


def _signalled(cmd: list[str], sig: int) -> tuple[int, str]:
    """Run ``cmd``, send ``sig`` to it once the trainer printed step 3 (where its first attempt waits:
    ``--hold-after 3``, so the signal lands there however loaded the machine is); (exit status, output)."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step:3"):
            proc.send_signal(sig)
    return proc.wait(timeout=60), "".join(lines)


def test_the_pre_timeout_signal_stops_the_attempt_and_asks_for_a_requeue(tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "state.json"
    cmd = _requeue_cmd(ckpt, state)
    rc, out = _signalled(cmd, signal.SIGUSR1)
    assert rc == sv.EXIT_REQUEUE, out
    # Stopped where the attempt waited, after step 3 (a step 4 printed would mean the stop went unheeded).
    assert "restart     1 of 2: Slurm's pre-timeout signal (USR1) at step 4; the job is requeued" in out, out
    assert "step:4" not in out and json.loads(state.read_text())["used"] == 1
    # The requeued job: the same command and state resume from the newest checkpoint (step 2, or 4) and finish.
    saved = (ckpt / "latest_checkpointed_iteration.txt").read_text()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0 and f"resume_mode=auto, from step {saved}, DS4_RESTART=1" in proc.stdout, proc.stdout
    # Negative control: SIGTERM (scancel, a person) stops the run for good, no requeue.
    rc, out = _signalled(_requeue_cmd(tmp_path / "ckpt2", tmp_path / "state2.json"), signal.SIGTERM)
    assert rc not in (0, sv.EXIT_REQUEUE) and "not restarted: stopped by SIGTERM" in out, out
    assert "step:4" not in out and _attempts(out) == 1


def _stopped_from_outside(cmd: list[str], supervisor_too: bool) -> tuple[int, str]:
    """``scancel``'s race: SIGTERM reaches the attempt (the stand-in trainer, waiting after step 3) first and the
    supervisor 1.5 s later (``supervisor_too``), as the batch shell passes it on; (exit status, output)."""
    import psutil

    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines, sent = [], False
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step:3") and not sent:
            sent = True
            for child in psutil.Process(proc.pid).children(recursive=True):
                if "standin_trainer" in " ".join(child.cmdline()):
                    child.send_signal(signal.SIGTERM)
            if supervisor_too:
                time.sleep(1.5)
                proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=120), "".join(lines)


def test_an_attempt_stopped_from_outside_waits_for_the_supervisors_own_stop(tmp_path):
    """scancel signals the job's steps and its batch shell at once; the attempt may end before the shell passed the
    signal on (seen on a loaded machine: the supervisor printed a restart, then was stopped). It waits for its own
    stop (:data:`verl_ds4.recipes.supervise.OUTSIDE_STOP_WAIT_S`) and then stops without a restart. Control: an
    attempt stopped by SIGTERM and nothing else is restarted after that wait."""
    rc, out = _stopped_from_outside(_requeue_cmd(tmp_path / "ckpt", tmp_path / "state.json"), supervisor_too=True)
    assert "not restarted: stopped by SIGTERM" in out and "restart     1 of" not in out, out
    assert rc not in (0, sv.EXIT_REQUEUE) and _attempts(out) == 1
    start = time.monotonic()
    rc, out = _stopped_from_outside(_requeue_cmd(tmp_path / "ckpt2", tmp_path / "state2.json"), supervisor_too=False)
    assert rc == 0 and "restart     1 of 2: attempt 1 failed at step 4 (stopped by SIGTERM" in out, out
    assert time.monotonic() - start >= sv.OUTSIDE_STOP_WAIT_S


def test_the_trainer_output_in_a_log_file_is_read_for_its_step_and_error(tmp_path):
    """As in the Slurm batch script, where the trainer's output goes to the node logs and srun prints nothing of it:
    ``--progress-log`` names the file. The rank is killed before any checkpoint (save every 10 steps)."""
    log, ckpt = tmp_path / "node0.log", tmp_path / "ckpt"

    def run(*extra):
        trainer = (f"{sys.executable} -m verl_ds4.testing.standin_trainer --ckpt-dir {ckpt} --steps 5 --save-freq 10 "
                   f"--kill-rank-at 4 --once {tmp_path / extra[0]} > {log} 2>&1")
        cmd = [sys.executable, "-m", "verl_ds4.recipes.supervise", "--max-restarts", "2", "--ckpt-dir", str(ckpt),
               *extra[1:], "--", "bash", "-c", trainer]
        return subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=REPO, timeout=60)

    out = run("once1", "--progress-log", str(log))
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("restart     1 of 2: attempt 1 failed at step 4 (a rank was killed by SIGKILL (torchrun: exitcode -9)); "
            "starting again from the start (no checkpoint yet)") in out.stdout, out.stdout
    # Negative control: without the log the supervisor sees an exit 1 and no step: a start-up failure, not restarted.
    shutil.rmtree(ckpt)
    out = run("once2")
    assert out.returncode == 1 and "failed at start-up, before its first training step (exit status 1)" in out.stdout


def _launcher(script: str, *args: str, **knobs: str) -> subprocess.CompletedProcess:
    env = {**_env(), "PYTHON": sys.executable, **knobs}
    for name in ("MAX_RESTARTS", "DS4_SUPERVISED", "DS4_CKPT_CHECKED", "WORK_DIR", "CKPT_DIR"):
        if name not in knobs:
            env.pop(name, None)
    return subprocess.run(["bash", f"scripts/{script}", *args], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=120)


@pytest.mark.parametrize("script, args", [
    ("run_ds4_proxy_sft_cpu.sh", ()), ("run_ds4_proxy_ppo_cpu.sh", ()),
    ("run_deepseek_v4_flash_sft_megatron.sh", ("--dry-run",)), ("run_deepseek_v4_flash_grpo_megatron.sh", ()),
])
def test_every_local_launcher_refuses_a_bad_budget_and_a_folder_it_cannot_write_before_anything_starts(
        script, args, tmp_path):
    start = time.monotonic()
    out = _launcher(script, *args, MAX_RESTARTS="three", WORK_DIR=str(tmp_path / "w"), CKPT_DIR=str(tmp_path / "c"))
    assert out.returncode == 2 and "MAX_RESTARTS='three': expected a non-negative integer" in out.stderr, out.stderr
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    folder = blocker / ("w/checkpoints" if "cpu" in script else "c")
    out = _launcher(script, MAX_RESTARTS="1", WORK_DIR=str(blocker / "w"), CKPT_DIR=str(blocker / "c"))
    assert out.returncode == 2 and f"the checkpoint folder {folder} is not writable" in out.stderr, out.stderr
    assert not (tmp_path / "w" / "assets").exists() and time.monotonic() - start < 60  # nothing built, seconds
    # MAX_RESTARTS=0 checks the folder too (the launcher runs without the supervisor then).
    out = _launcher(script, MAX_RESTARTS="0", WORK_DIR=str(blocker / "w"), CKPT_DIR=str(blocker / "c"))
    assert out.returncode == 2 and f"the checkpoint folder {folder} is not writable" in out.stderr, out.stderr


def test_the_cluster_launchers_refuse_a_bad_budget_and_print_theirs(tmp_path):
    for script, args in (("slurm_submit.sh", ("--dry-run", "sft")), ("ray_cluster.sh", ("--dry-run", "submit", "ppo")),
                         ("slurm_sft.sbatch", ("--dry-run",))):
        out = _launcher(script, *args, MAX_RESTARTS="-1")
        assert out.returncode == 2 and "MAX_RESTARTS='-1': expected a non-negative integer" in out.stderr, out.stderr
        good = _launcher(script, *args)  # control: the default, 3, in the plan
        assert good.returncode == 0 and "[verl-ds4] restarts    MAX_RESTARTS=3" in good.stdout, good.stdout + good.stderr
    sbatch = _launcher("slurm_submit.sh", "--dry-run", "sft", REQUEUE_BEFORE_S="600").stdout
    assert "--signal=B:USR1@600" in sbatch and "--requeue" in sbatch
