"""Checkpoints known complete when written, verified before they are loaded (verl's Megatron engines).

verl 0.9.1's order, and what verl-ds4 changes (:mod:`verl_ds4.ckpt_manifest` says what a manifest is):

* the engine's ``save_checkpoint`` (verl's ``MegatronCheckpointManager``) deletes old checkpoints for
  ``max_ckpt_to_keep >= 2`` *before* the new save and the rest right after its own files, before the
  trainer has written the dataloader state and the tracker. :class:`ManifestCheckpointEngine` calls verl's
  save with no rotation, writes the manifest of the engine's folder on rank 0 once every rank has
  finished (verl's barrier), and only then rotates (with verl's own ``remove_previous_save_local_path``);
  inside verl's SFT handler (below) the engine writes into the step folder itself, so it writes no
  manifest there and leaves the manifest and the rotation to the handler;
* verl's SFT ``CheckpointHandler.save_checkpoint`` writes ``data_<dp>.pt`` and then, on rank 0, the
  tracker ``latest_checkpointed_iteration.txt`` without waiting for the other ranks' files.
  :func:`handler_save_checkpoint` (installed on verl's class by :func:`verl_ds4.engine.megatron.install_verl_hooks`)
  runs verl's method with the tracker written under a pending name, then (after verl's final barrier) the
  step's manifest covering every rank's files, then the tracker, then the rotation;
* verl's RL trainer (``verl.trainer.ppo.v1.trainer_base.PPOTrainer._save_checkpoint``, every v1 trainer
  mode) writes ``latest_checkpointed_iteration.txt`` with a plain ``open(..., "w")`` and only then calls the
  checkpoint callback, where :class:`verl_ds4.recipes.resume_check.RunRecordCallback` writes the step's
  manifest. :func:`trainer_save_checkpoint` (installed on verl's class by that callback's constructor, on the
  driver, through :func:`install_trainer_hook`) runs verl's method with that one path redirected to a pending
  name, and renames it to the tracker after verl's method (and so the callback's manifest) returned;
* ``load_checkpoint`` verifies the folder against its manifest (sizes) before Megatron reads a byte, and
  raises :class:`~verl_ds4.ckpt_manifest.CheckpointDamagedError` naming the file and the fix.

Every save first gives Megatron's checkpoint writer a results queue whose server process ends with the rank
(:mod:`verl_ds4.engine.writer_queue`): Megatron's own outlives a killed rank.

Async saves (``checkpoint.async_save``) get no manifest (the files are still being written when the save
returns); the start-up check then treats them as checkpoints without one.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
import time

from verl_ds4.ckpt_manifest import TRACKER_NAME, CheckpointDamagedError, mark_manifests_since, verify_folder, write_manifest
from verl_ds4.engine import writer_queue

__all__ = [
    "ManifestCheckpointEngine",
    "handler_save_checkpoint",
    "install_trainer_hook",
    "trainer_save_checkpoint",
    "uninstall_trainer_hook",
]

PENDING_SUFFIX = ".verl_ds4_pending"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rotate(engine, max_ckpt_to_keep) -> None:
    """Delete the engine's oldest saves beyond ``max_ckpt_to_keep`` (verl's rule), after the newest is complete."""
    manager = getattr(engine, "checkpoint_mananager", None)  # sic: verl 0.9.1's attribute name
    saved = getattr(manager, "previous_saved_paths", None)
    if not (isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0 and saved and len(saved) > max_ckpt_to_keep):
        return
    old = saved[:-max_ckpt_to_keep]
    if _rank() == 0:
        manager.remove_previous_save_local_path(old)
    manager.previous_saved_paths = saved[-max_ckpt_to_keep:]
    _barrier()


class ManifestCheckpointEngine:
    """Mixin over verl's Megatron engine: a manifest ends every save; loads are verified first."""

    #: Set by :func:`handler_save_checkpoint`: the trainer writes more files, the manifest and rotates itself.
    _verl_ds4_in_handler: bool = False
    _verl_ds4_pending_rotation = None
    _verl_ds4_manifest_seconds = 0.0

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        writer_queue.install()  # Megatron's writer-results process then ends with this rank (see the module)
        if getattr(getattr(self, "checkpoint_config", None), "async_save", False):
            return super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
        result = super().save_checkpoint(local_path, hdfs_path, global_step, None, **kwargs)
        _barrier()  # verl's engine has one too; every rank's files are written
        # Inside verl's SFT handler the engine writes into the step folder itself, and the dataloader files
        # follow: a manifest there now would make the step look complete before it is. The handler writes it.
        if _rank() == 0 and not self._verl_ds4_in_handler:
            t0 = time.perf_counter()
            write_manifest(local_path, global_step=global_step)
            self._verl_ds4_manifest_seconds = time.perf_counter() - t0
        _barrier()
        if self._verl_ds4_in_handler:
            self._verl_ds4_pending_rotation = max_ckpt_to_keep
        else:
            rotate(self, max_ckpt_to_keep)
        return result

    def load_checkpoint(self, local_path, *args, **kwargs):
        problems = verify_folder(local_path)
        if problems:
            shown = "\n".join(f"  - {p}" for p in problems[:8])
            raise CheckpointDamagedError(
                f"verl-ds4: refusing to load {local_path}: the checkpoint is damaged or unfinished:\n{shown}\n"
                "Fix: resume from an intact checkpoint (trainer.resume_mode=auto through the launcher skips damaged "
                "ones: python -m verl_ds4.recipes.ckpt_resume -- <overrides>), or restore this folder from a copy."
            )
        return super().load_checkpoint(local_path, *args, **kwargs)


@contextlib.contextmanager
def _tracker_pending(handler_module):
    """verl's handler writes its tracker under a pending name while this is active."""
    original = handler_module.get_checkpoint_tracker_filename
    handler_module.get_checkpoint_tracker_filename = lambda root: original(root) + PENDING_SUFFIX
    try:
        yield original
    finally:
        handler_module.get_checkpoint_tracker_filename = original


def handler_save_checkpoint(verl_save):
    """verl's ``CheckpointHandler.save_checkpoint`` -> one that advances the tracker after the manifest."""
    import sys

    def save_checkpoint(self, step):
        engine = self.engine
        if not isinstance(engine, ManifestCheckpointEngine) or getattr(self, "mode", None) is None or \
                getattr(self.mode, "name", "") != "SPMD":
            return verl_save(self, step)
        handler_module = sys.modules[verl_save.__module__]  # verl.utils.checkpoint.checkpoint_handler
        if _rank() == 0:
            mark_manifests_since(self.default_local_dir, step)
        engine._verl_ds4_in_handler = True
        try:
            with _tracker_pending(handler_module) as tracker_of:
                verl_save(self, step)  # shards, data_<dp>.pt, the pending tracker, verl's final barrier
        finally:
            engine._verl_ds4_in_handler = False
        if _rank() == 0:
            t0 = time.perf_counter()
            manifest = write_manifest(os.path.join(self.default_local_dir, f"global_step_{step}"), global_step=step)
            tracker = tracker_of(self.default_local_dir)
            os.replace(tracker + PENDING_SUFFIX, tracker)
            print(f"[verl-ds4] checkpoint manifest {manifest} written in {time.perf_counter() - t0:.3f} s; "
                  f"tracker -> step {step}", flush=True)
        _barrier()
        rotate(engine, engine._verl_ds4_pending_rotation)

    save_checkpoint.__verl_ds4_hook__ = True
    save_checkpoint.__wrapped__ = verl_save
    return save_checkpoint


def _open_with_pending_tracker(tracker: str):
    """``open`` that writes ``tracker`` under its pending name; every other call is the builtin's."""

    def open_(file, mode="r", *args, **kwargs):
        if "w" in mode and isinstance(file, (str, os.PathLike)) and os.path.abspath(os.fspath(file)) == tracker:
            file = tracker + PENDING_SUFFIX
        return builtins.open(file, mode, *args, **kwargs)

    return open_


def trainer_save_checkpoint(verl_save):
    """verl's v1 ``PPOTrainer._save_checkpoint`` -> one that advances the tracker after the step's manifest.

    verl's method runs unchanged, except that its ``open`` of the tracker (a name looked up in its module's
    globals before the builtins) writes a pending file; the checkpoint callback it calls last writes the
    step's manifest; then the pending file is renamed to the tracker. A save that stops anywhere before
    leaves the tracker on the previous step. An async save writes no tracker: nothing is renamed.
    """

    def _save_checkpoint(self):
        module = sys.modules[verl_save.__module__]
        tracker = os.path.abspath(os.path.join(str(self.config.trainer.default_local_dir), TRACKER_NAME))
        pending = tracker + PENDING_SUFFIX
        namespace = vars(module)
        saved = namespace.get("open", _MISSING)
        namespace["open"] = _open_with_pending_tracker(tracker)
        try:
            result = verl_save(self)  # actor/critic (their manifests), data.pt, pending tracker, callback (manifest)
        finally:
            if saved is _MISSING:
                namespace.pop("open", None)
            else:
                namespace["open"] = saved
        if os.path.exists(pending):
            os.replace(pending, tracker)
        return result

    _save_checkpoint.__verl_ds4_hook__ = True
    _save_checkpoint.__wrapped__ = verl_save
    return _save_checkpoint


_MISSING = object()


def install_trainer_hook() -> bool:
    """Wrap verl's v1 ``PPOTrainer._save_checkpoint`` (idempotent); False when verl's trainer is not imported.

    Called by the RL checkpoint callback's constructor, which verl's trainer runs on the driver (so the
    trainer's module is imported by then); workers never import the trainer, so this is not a VERL_HOOK.
    """
    module = sys.modules.get(TRAINER_MODULE)
    trainer = getattr(module, "PPOTrainer", None)
    if trainer is None:
        return False
    current = trainer.__dict__.get("_save_checkpoint")
    if current is None:
        return False
    if not getattr(current, "__verl_ds4_hook__", False):
        trainer._save_checkpoint = trainer_save_checkpoint(current)
    return True


def uninstall_trainer_hook() -> None:
    """Put verl's ``PPOTrainer._save_checkpoint`` back (idempotent; for tests)."""
    trainer = getattr(sys.modules.get(TRAINER_MODULE), "PPOTrainer", None)
    current = trainer.__dict__.get("_save_checkpoint") if trainer is not None else None
    if getattr(current, "__verl_ds4_hook__", False):
        trainer._save_checkpoint = current.__wrapped__
