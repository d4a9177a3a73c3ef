"""Automatic restart: a run that dies starts again from its newest intact checkpoint, within a budget.

Every launcher runs its job through :func:`supervise` (the single-node launchers around themselves, the Slurm
SFT batch script around its ``srun`` step). Before the first attempt it refuses, naming what is wrong:
a ``MAX_RESTARTS`` that is not a non-negative integer, and a checkpoint folder that cannot be written or has
less room than one more checkpoint (:func:`check_ckpt_dir`), so nothing is built that could not be saved.

Each attempt runs the command with its output passed through unchanged (the last lines are kept to name
the failure). When it exits non-zero, :func:`decide` says whether a restart can help:

* restarted: a process killed by a signal (a rank or node lost; torchrun's ``exitcode: -9``), a non-zero
  exit of the trainer after its first step; Slurm's pre-timeout signal (``--requeue-signal USR1``) stops
  the attempt and exits :data:`EXIT_REQUEUE` for the batch script to requeue the job;
* not restarted, at once, with the reason: a failure before the attempt's first training step that no
  signal caused (a config error or a refusal at start-up: the restart would fail the same way), the same
  step failing the same way twice, two attempts in a row that started from the same checkpoint and left
  no newer intact one (no intact checkpoint progress), checkpoints of which none is intact, and an empty
  budget.

A restart runs the same command with ``RESUME_MODE=auto`` and an empty ``RESUME_FROM`` when the checkpoint
folder holds an intact checkpoint (the launcher's start-up check then resumes from the newest intact one). Every
attempt gets ``DS4_SUPERVISED=1`` (the launcher does not supervise itself again), ``DS4_RESTART=<k>`` and, when the
supervisor checked the folder, ``DS4_CKPT_CHECKED=1``. A run that started with another ``--resume-mode`` than
``auto`` is restarted only when its folder held no checkpoint at its start. ``--state FILE`` keeps the restarts
used and the failures across a Slurm requeue.

    python -m verl_ds4.recipes.supervise --max-restarts N [--ckpt-dir DIR] [--resume-mode MODE] [--state FILE]
        [--requeue-signal USR1] [--progress-log FILE ...] [--check-only] -- COMMAND...

``--progress-log``: a file the command writes the trainer's output to (the Slurm SFT batch script's node logs,
which srun does not print), read after each attempt for its last step and its error. Running one attempt:
:mod:`verl_ds4.recipes.supervise_attempt`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

from verl_ds4.ckpt_manifest import step_folders
from verl_ds4.recipes.supervise_attempt import Attempt, Runner, failure_reason, signal_name

__all__ = ["EXIT_REQUEUE", "Attempt", "SuperviseError", "check_ckpt_dir", "check_overrides", "decide", "failure_reason",
           "main", "parse_budget", "supervise"]

EXIT_REQUEUE = 75  # the attempt was stopped by the pre-timeout signal: the batch script requeues the job
MIN_FREE = 64 << 20  # bytes a checkpoint folder must have free at least, when it holds no checkpoint yet
#: An attempt that ended only because it was stopped (SIGTERM, SIGINT, SIGHUP: no rank lost, no error) was most
#: likely stopped from outside: ``scancel`` signals the job's steps and its batch shell at once, and the shell passes
#: the signal on to this process a moment later (seconds, on a loaded machine). The supervisor waits this long for
#: its own stop before it takes the attempt for a failure to restart.
OUTSIDE_STOP_WAIT_S = 10.0

class SuperviseError(Exception):
    """A refusal at start-up (bad MAX_RESTARTS, a checkpoint folder that cannot take a checkpoint)."""


def parse_budget(text: str, name: str = "MAX_RESTARTS") -> int:
    """``text`` as a restart budget: a non-negative integer, else :class:`SuperviseError` with the fix."""
    if not re.fullmatch(r"[0-9]+", str(text).strip()):
        raise SuperviseError(
            f"verl-ds4: {name}={text!r}: expected a non-negative integer, the restarts allowed after the run dies "
            f"(e.g. {name}=3; {name}=0 stops at the first failure)")
    return int(str(text).strip())


def check_overrides(cmd: list[str], budget: int) -> None:
    """Refuse a resume override in the command that a restart could not replace (the trainer's overrides come last:
    ``trainer.resume_mode=disable`` would start every restart from scratch, a ``resume_from_path`` would go back to
    that checkpoint), unless the budget is 0."""
    for arg in cmd if budget else ():
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and (key == "trainer.resume_from_path" and value not in ("", "null") or
                    key == "trainer.resume_mode" and value != "auto"):
            raise SuperviseError(
                f"verl-ds4: {arg} with MAX_RESTARTS={budget}: a restart resumes with resume_mode=auto from the newest "
                "intact checkpoint, which this override would undo; set the launcher's RESUME_MODE / RESUME_FROM "
                "instead of the override, or MAX_RESTARTS=0")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check_ckpt_dir(ckpt_dir: str | Path, *, min_free: int = MIN_FREE) -> str:
    """Refuse a checkpoint folder that cannot take one more checkpoint; return a fact line about it.

    The folder is created if missing; a probe file is written and removed; the free space must be at least
    the newest checkpoint's size (one more save), and ``min_free`` when there is none.
    """
    folder = Path(str(ckpt_dir)).expanduser().absolute()
    fix = "or point the run at another folder (CKPT_DIR; WORK_DIR for the CPU jobs)"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".verl_ds4_write_probe_{uuid.uuid4().hex}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise SuperviseError(
            f"verl-ds4: the checkpoint folder {folder} is not writable ({e.strerror or e}): no checkpoint could be "
            f"saved there; fix its permissions {fix}") from None
    steps = step_folders(folder)
    need, what = min_free, f"{min_free >> 20} MiB, the least verl-ds4 accepts"
    if steps:
        newest = steps[max(steps)]
        need = max(need, _size(newest))
        what = f"{need >> 20} MiB, the size of {newest.name}"
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SuperviseError(
            f"verl-ds4: the checkpoint folder {folder} has {free >> 20} MiB free, less than one more checkpoint "
            f"needs ({what}): free space there {fix}")
    return f"{folder} (writable, {free >> 30} GiB free)"


def newest_intact(ckpt_dir: str | Path | None) -> tuple[int | None, str | None]:
    """(the newest intact checkpoint step, None) or (None, why there is none to restart from)."""
    if ckpt_dir is None:
        return None, None
    from verl_ds4.recipes.ckpt_resume import CheckpointDamagedError, choose_resume

    try:
        return choose_resume(ckpt_dir, "auto", apply=False).step, None
    except CheckpointDamagedError:
        return None, (f"{ckpt_dir} holds checkpoints but none is intact (verl-ds4 doctor --checkpoint {ckpt_dir} "
                      "names the damage)")


def decide(history: list[Attempt], newest: int | None, none_intact: str | None, left: int,
           known: bool = True) -> tuple[bool, str]:
    """Whether the last failed attempt of ``history`` is restarted, and why (or why not).

    ``known``: the checkpoint folder is known (``newest`` means something); without it there is no progress rule.
    """
    a = history[-1]
    where = f"at step {a.failed_at}"
    failed = [h for h in history[:-1] if h.returncode != 0]
    if failed and failed[-1].signature == a.signature:
        return False, (f"attempt {a.number} failed {where} the same way as attempt {failed[-1].number} ({a.reason}): "
                       "a fault a restart does not fix; fix what its output names")
    if a.last_step is None and a.signal is None:
        return False, (f"attempt {a.number} failed at start-up, before its first training step ({a.reason}): a config "
                       "error or a refusal, which a restart would meet again; fix what its output names")
    if none_intact:
        return False, f"attempt {a.number} failed {where} ({a.reason}), and no checkpoint to restart from: {none_intact}"
    if known and failed and failed[-1].resumed_from == a.resumed_from and newest == a.resumed_from:
        start = f"step {a.resumed_from}" if a.resumed_from is not None else "scratch"
        return False, (f"attempt {a.number} failed {where} ({a.reason}) with no intact checkpoint progress: it and "
                       f"attempt {failed[-1].number} both started from {start} and saved no newer checkpoint; save "
                       "more often (trainer.save_freq) or fix the fault")
    if left <= 0:
        return False, f"attempt {a.number} failed {where} ({a.reason}), and no restart is left (MAX_RESTARTS)"
    return True, f"attempt {a.number} failed {where} ({a.reason})"


def say(text: str) -> None:
    print(f"[verl-ds4] {text}", flush=True)


def _load_state(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {"used": 0, "attempts": []}
    return json.loads(path.read_text())


def _save_state(path: Path | None, state: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)


def supervise(cmd: list[str], *, max_restarts: int, ckpt_dir: str | Path | None = None,
              state_file: str | Path | None = None, requeue_signal: str | None = None,
              resume_mode: str = "auto", progress_logs=(), env: dict | None = None) -> int:
    """Run ``cmd``, restarting it after a failure a restart can fix, at most ``max_restarts`` times in all.

    ``progress_logs``: files an attempt writes its output to (read after it, for its steps and errors).
    ``resume_mode`` is the run's own (``RESUME_MODE``): a run that did not start with ``auto`` (``disable``, or
    ``resume_path`` to a given checkpoint) is restarted with ``auto`` only when its checkpoint folder held no
    checkpoint at its start, so that every checkpoint a restart may resume from is this run's.
    """
    state_path = Path(state_file) if state_file else None
    state = _load_state(state_path)
    state.setdefault("fresh", ckpt_dir is None or not step_folders(Path(str(ckpt_dir)).expanduser()))
    history = [Attempt(**a) for a in state["attempts"]]
    runner = Runner()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: runner.stop(f"stopped by {signal_name(s)}"))
    if requeue_signal:
        signal.signal(getattr(signal, "SIG" + requeue_signal.removeprefix("SIG")),
                      lambda s, _f: runner.stop("requeue"))
    base = dict(os.environ if env is None else env)
    while True:
        newest, _ = newest_intact(ckpt_dir)
        attempt = Attempt(len(history) + 1, newest)
        child = {**base, "DS4_SUPERVISED": "1", "DS4_RESTART": str(state["used"])}
        if ckpt_dir is not None:
            child["DS4_CKPT_CHECKED"] = "1"  # the launcher need not check the folder again
        if state["used"] and newest is not None:
            child.update(RESUME_MODE="auto", RESUME_FROM="")
        runner.run(cmd, child, attempt, progress_logs)
        if attempt.returncode != 0 and attempt.signal is None and attempt.reason.startswith("stopped by"):
            deadline = time.monotonic() + OUTSIDE_STOP_WAIT_S  # our own stop may still be on its way (see above)
            while runner.stop_reason is None and time.monotonic() < deadline:
                time.sleep(0.1)
        after, none_intact = newest_intact(ckpt_dir)
        if attempt.last_step is None and after is not None and after > (newest or 0):
            attempt.last_step = after  # it printed no step we saw, but saved a newer checkpoint: it trained
        history.append(attempt)
        state["attempts"] = [dataclasses.asdict(a) for a in history]
        _save_state(state_path, state)
        left = max_restarts - state["used"]
        if runner.stop_reason == "requeue":
            pre = f"Slurm's pre-timeout signal ({requeue_signal}) at step {attempt.failed_at}"
            if left <= 0:
                say(f"not restarted: {pre}, and no restart is left (MAX_RESTARTS)")
                return attempt.returncode or 143
            state["used"] += 1
            _save_state(state_path, state)
            say(f"restart     {state['used']} of {max_restarts}: {pre}; the job is requeued and resumes from the newest "
                f"intact checkpoint (steps after it are trained again); {left - 1} tries left")
            return EXIT_REQUEUE
        if runner.stop_reason:
            say(f"not restarted: {runner.stop_reason} (a person or the scheduler stopped the run)")
            return attempt.returncode or 143
        if attempt.returncode == 0:
            if state["used"]:
                say(f"finished after {state['used']} restart(s)")
            return 0
        retry, why = decide(history, after, none_intact, left, known=ckpt_dir is not None)
        if retry and resume_mode != "auto" and not state["fresh"]:
            retry, why = False, (f"{why}; it started with RESUME_MODE={resume_mode} in {ckpt_dir}, which already held "
                                 "checkpoints of an earlier run that a restart (resume_mode=auto) could resume from; "
                                 "use RESUME_MODE=auto, or a new folder (WORK_DIR / CKPT_DIR) for a fresh run")
        if not retry:
            say(f"not restarted: {why}")
            return attempt.returncode
        state["used"] += 1
        _save_state(state_path, state)
        start = (f"step {after} (the newest intact checkpoint in {ckpt_dir}), resume_mode=auto" if after is not None
                 else "the start (no checkpoint yet)" if ckpt_dir else "its newest intact checkpoint (resume_mode=auto)")
        say(f"restart     {state['used']} of {max_restarts}: {why}; starting again from {start}; {left - 1} tries left")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description="Run a training command; restart it from its newest intact "
                                     "checkpoint when it dies, within a budget.")
    parser.add_argument("--max-restarts", required=True, help="the restart budget (MAX_RESTARTS)")
    parser.add_argument("--ckpt-dir", help="the run's checkpoint folder (checked at start-up; restarts resume there)")
    parser.add_argument("--state", help="a JSON file keeping the restarts used across a Slurm requeue")
    parser.add_argument("--requeue-signal", choices=["USR1", "USR2"],
                        help="Slurm's pre-timeout signal: stop the attempt and exit 75 for the batch script to requeue")
    parser.add_argument("--resume-mode", default="auto",
                        help="the run's RESUME_MODE (a restart itself uses auto)")
    parser.add_argument("--progress-log", action="append", default=[], metavar="FILE",
                        help="a file the command writes the trainer's output to (the Slurm node logs), read after "
                             "each attempt for its last step and its error")
    parser.add_argument("--check-only", action="store_true", help="only the start-up checks")
    args = parser.parse_args(argv)
    try:
        budget = parse_budget(args.max_restarts)
        check_overrides(cmd, budget)
        folder = check_ckpt_dir(args.ckpt_dir) if args.ckpt_dir else None
    except SuperviseError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.check_only:
        return 0
    if not cmd:
        parser.error("expected the command to run after `--`")
    say(f"restarts    MAX_RESTARTS={budget}: a run that dies is started again from its newest intact checkpoint "
        f"(resume_mode=auto), at most {budget} time(s)" + (f"; checkpoints {folder}" if folder else ""))
    status = supervise(cmd, max_restarts=budget, ckpt_dir=args.ckpt_dir, state_file=args.state,
                       requeue_signal=args.requeue_signal, resume_mode=args.resume_mode,
                       progress_logs=args.progress_log)
    return 128 - status if status < 0 else status  # killed by signal N: the shell's 128 + N


if __name__ == "__main__":
    raise SystemExit(main())
