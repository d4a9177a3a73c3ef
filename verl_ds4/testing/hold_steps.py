"""Hold a real CPU run at a chosen moment until a test lets it go (tests, the chaos runs): no race with the steps.

Imported in the trainer's processes through ``VERL_USE_EXTERNAL_MODULES`` (the CPU launchers add
``$VERL_DS4_TEST_MODULES`` to their list; the RL launcher also to its Ray workers') with
``VERL_DS4_TEST_HOLD_DIR=<dir>``:

* SFT, before training step N: every rank waits while ``<dir>/hold_<N>`` exists, after writing
  ``<dir>/held_<N>.<rank>``: step N-1 is printed and its save (if any) ended, step N has not begun;
* RL (verl's Ray PPO trainer, GRPO too), before step N: the driver waits while ``<dir>/hold_<N>`` exists, after writing
  ``<dir>/held_<N>.driver`` (where the trainer moves to step N: step N-1 is logged and its save ended);
* in the save of step N, rank 0 waits while ``<dir>/hold_save_<N>`` exists, after writing ``<dir>/held_save_<N>``,
  just before verl-ds4 writes the step's manifest (SFT: the step folder's; RL: the actor's): every rank's files are
  in the folder, the manifest is not, the tracker is on the step before (the other ranks wait in the save's barrier).

A test creates the hold file before the run reaches the moment, waits for the ``held`` markers, does what it wants
there (freeze, kill, signal), then removes the hold file. The steps are verl's SFT trainer's own numbering (its
``fit`` loop's ``global_step``, which counts from the resumed step). A hold never released ends after
:data:`MAX_HOLD_S` with an error, so a test that died does not leave a run waiting for ever. Without the variable
nothing is changed.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

ENV = "VERL_DS4_TEST_HOLD_DIR"
MAX_HOLD_S = 1800.0
POLL_S = 0.05


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _hold(folder: Path, name: str, marker: str) -> None:
    hold = folder / name
    if not hold.exists():
        return
    (folder / marker).write_text(f"{os.getpid()}\n")
    start = time.monotonic()
    while hold.exists():
        if time.monotonic() - start > MAX_HOLD_S:
            raise RuntimeError(f"verl-ds4 test hold {hold}: not released after {MAX_HOLD_S:.0f} s")
        time.sleep(POLL_S)


def _caller_step() -> int | None:
    """verl's SFT trainer's ``global_step`` in ``fit``, the caller of ``TrainingWorker.train_batch`` (None elsewhere:
    an RL worker's update, whose steps the driver's hold counts)."""
    step = sys._getframe(2).f_locals.get("global_step")
    return step if isinstance(step, int) else None


def install() -> bool:
    """Wrap verl's ``TrainingWorker.train_batch``, the RL trainer's move to the next step (verl's
    ``SkipManager.set_step``, called by the driver once per step) and verl-ds4's manifest write (idempotent); False
    without the variable."""
    where = os.environ.get(ENV)
    if not where:
        return False
    folder = Path(where)
    from verl.workers.engine_workers import TrainingWorker

    from verl_ds4.engine import checkpoint

    train_batch = TrainingWorker.train_batch
    if not getattr(train_batch, "__verl_ds4_hold__", False):
        @functools.wraps(train_batch)
        def held_train_batch(self, *args, **kwargs):
            step = _caller_step()
            if step is not None:
                _hold(folder, f"hold_{step}", f"held_{step}.{_rank()}")
            return train_batch(self, *args, **kwargs)

        held_train_batch.__verl_ds4_hold__ = True
        TrainingWorker.train_batch = held_train_batch

    from verl.utils.skip.skip_manager import SkipManager

    set_step = SkipManager.__dict__["set_step"].__func__
    if not getattr(set_step, "__verl_ds4_hold__", False):
        @functools.wraps(set_step)
        def held_set_step(cls, step: int):
            _hold(folder, f"hold_{step}", f"held_{step}.driver")
            return set_step(cls, step)

        held_set_step.__verl_ds4_hold__ = True
        SkipManager.set_step = classmethod(held_set_step)

    write_manifest = checkpoint.write_manifest
    if not getattr(write_manifest, "__verl_ds4_hold__", False):
        @functools.wraps(write_manifest)
        def held_write_manifest(path, *args, global_step=None, **kwargs):
            if global_step is not None:
                _hold(folder, f"hold_save_{global_step}", f"held_save_{global_step}")
            return write_manifest(path, *args, global_step=global_step, **kwargs)

        held_write_manifest.__verl_ds4_hold__ = True
        checkpoint.write_manifest = held_write_manifest
    return True


install()
