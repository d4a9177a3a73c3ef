"""A stand-in trainer for the restart tests (:mod:`verl_ds4.recipes.supervise`): a real process, no model.

It resumes like a launcher does (``RESUME_MODE`` from the environment, the start-up check
:func:`verl_ds4.recipes.ckpt_resume.choose_resume`), prints verl's console line per step
(``step:N - train/loss:X``, the loss a function of the step only) and saves ``global_step_N`` with a
manifest, then the tracker, as verl-ds4's engines do. Faults, each at a chosen step of the run:

* ``--kill-at N``: SIGKILLs itself before step N (once, when ``--once FILE`` is given: FILE marks it done);
* ``--kill-rank-at N``: a child "rank" is SIGKILLed before step N and the trainer exits 1 with torchrun's
  report line (``exitcode: -9``), once with ``--once``;
* ``--raise-at N``: raises ``RuntimeError`` at step N, every time;
* ``--refuse``: exits 2 with a start-up refusal before step 1;
* ``--kill-every N``: SIGKILLs itself after N steps of every attempt.

    python -m verl_ds4.testing.standin_trainer --ckpt-dir DIR --steps 8 [--save-freq 2] [fault]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from verl_ds4.ckpt_manifest import TRACKER_NAME, write_manifest


def loss_at(step: int) -> float:
    return round(4.0 / (1.0 + 0.25 * step), 6)


def _once(marker: str | None) -> bool:
    """True the first time (creates the marker); always True without a marker."""
    if marker is None:
        return True
    if Path(marker).exists():
        return False
    Path(marker).write_text(str(os.getpid()))
    return True


def _save(ckpt: Path, step: int) -> None:
    folder = ckpt / f"global_step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.pt").write_bytes(step.to_bytes(8, "little") * 512)
    write_manifest(folder, global_step=step)
    tmp = ckpt / (TRACKER_NAME + ".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, ckpt / TRACKER_NAME)
    print(f"saved checkpoint to {folder}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-freq", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.02, help="seconds per step")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-rank-at", type=int)
    p.add_argument("--raise-at", type=int)
    p.add_argument("--kill-every", type=int)
    p.add_argument("--refuse", action="store_true")
    p.add_argument("--once", help="a marker file: the --kill-at / --kill-rank-at fault happens once")
    p.add_argument("--hold-after", type=int, help="the first attempt (DS4_RESTART unset or 0) waits after this "
                   "step (up to 120 s) for a signal to stop it: a test's signal then lands at a known step")
    args = p.parse_args(argv)
    if args.refuse:
        print("error: trainer.total_training_steps=-1: expected a positive integer (a stand-in refusal)", file=sys.stderr)
        return 2
    from verl_ds4.recipes.ckpt_resume import choose_resume

    ckpt = Path(args.ckpt_dir)
    mode = os.environ.get("RESUME_MODE", "auto")
    start = choose_resume(ckpt, mode).step or 0
    print(f"stand-in trainer: pid {os.getpid()}, resume_mode={mode}, from step {start}, "
          f"DS4_RESTART={os.environ.get('DS4_RESTART', '-')}", flush=True)
    for step in range(start + 1, args.steps + 1):
        if step == args.kill_at and _once(args.once):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.kill_rank_at and _once(args.once):
            rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            rank.send_signal(signal.SIGKILL)
            rank.wait()
            print(f"torch.distributed.elastic.multiprocessing.api:[ERROR] failed (exitcode: {rank.returncode}) "
                  f"local_rank: 1 (pid: {rank.pid}) of binary: {sys.executable}", flush=True)
            return 1
        if args.kill_every and step - start > args.kill_every:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.raise_at:
            raise RuntimeError(f"stand-in fault at step {step}")
        time.sleep(args.step_s)
        print(f"step:{step} - train/loss:{loss_at(step)!r} - train/lr:0.001", flush=True)
        if step % args.save_freq == 0 or step == args.steps:
            _save(ckpt, step)
        if step == args.hold_after and os.environ.get("DS4_RESTART", "0") == "0":
            time.sleep(120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
