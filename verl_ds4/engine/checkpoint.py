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

Async saves (``checkpoint.async_save=True``, Megatron's async dist-checkpointing): the save returns while
forked writers still write the shards, and Megatron finalises it later (``.metadata``, then the finalize
callbacks verl attached: ``ckpt_contents.json`` and the rotation) on every rank, whenever someone calls
``async_calls.maybe_finalize_async_calls`` - which nothing in verl 0.9.1 does. :class:`ManifestCheckpointEngine`
does: without blocking before every training step (:meth:`~ManifestCheckpointEngine.finish_async_saves`),
blocking before the next save and when verl's SFT trainer's ``fit`` returns (:func:`install_sft_fit_hook`).
It queues one more finalize request behind verl's, so that, once every rank's write is finalised, a barrier,
then the manifest (rank 0), then the tracker (SFT: written by verl under the pending name, put in place
now), then the rotation run, in that order. A run killed while a save is in flight leaves that step without
a manifest and the tracker on the previous step (the start-up check falls back to it). verl's own finalize
writes the tracker of the folder two levels up (``dirname(dirname(local_path))``: for an SFT step the folder
*above* the run's) with a plain ``open``: that write goes to ``os.devnull``. Async saves are finalised in
verl's torchrun SFT trainer only: an engine built anywhere else (verl's RL workers, the Ray SFT trainer) with
``async_save=True`` is refused at construction (:func:`check_async_save_supported`): there no one would ever
finalise the saves, and the last one of a run would be lost.
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
    "AsyncSaveUnsupportedError",
    "ManifestCheckpointEngine",
    "check_async_save_supported",
    "handler_save_checkpoint",
    "install_sft_fit_hook",
    "install_trainer_hook",
    "sft_fit",
    "trainer_save_checkpoint",
    "uninstall_sft_fit_hook",
    "uninstall_trainer_hook",
]

PENDING_SUFFIX = ".verl_ds4_pending"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
SFT_TRAINER_MODULE = "verl.trainer.sft_trainer"
_MISSING = object()
VERL_MANAGER_MODULE = "verl.utils.checkpoint.megatron_checkpoint_manager"


class AsyncSaveUnsupportedError(ValueError):
    """``async_save=True`` where no one would finalise the saves (the message names the fix)."""


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


def _async_save_on(engine) -> bool:
    return bool(getattr(getattr(engine, "checkpoint_config", None), "async_save", False))


def _async_calls():
    """Megatron's process-wide queue of async save requests (the one verl schedules its saves on)."""
    from megatron.core.dist_checkpointing.strategies.base import async_calls

    return async_calls


@contextlib.contextmanager
def _module_open(module_name: str, open_):
    """Within the block, module ``module_name``'s global ``open`` is ``open_`` (a no-op if it is not imported)."""
    module = sys.modules.get(module_name)
    if module is None:
        yield
        return
    namespace = vars(module)
    saved = namespace.get("open", _MISSING)
    namespace["open"] = open_
    try:
        yield
    finally:
        if saved is _MISSING:
            namespace.pop("open", None)
        else:
            namespace["open"] = saved


def _open_redirected(redirects: dict[str, str]):
    """``open`` that writes each path of ``redirects`` (absolute) to its target; every other call is the builtin's."""

    def open_(file, mode="r", *args, **kwargs):
        if "w" in mode and isinstance(file, (str, os.PathLike)):
            file = redirects.get(os.path.abspath(os.fspath(file)), file)
        return builtins.open(file, mode, *args, **kwargs)

    return open_


def _write_tracker(tracker: str, step: int) -> None:
    """verl's tracker ``tracker`` -> ``step``, atomically (a pending file verl wrote for it is dropped)."""
    tmp = tracker + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, tracker)
    with contextlib.suppress(FileNotFoundError):
        os.remove(tracker + PENDING_SUFFIX)


class _AsyncSaveDone:
    """The finalize callback verl-ds4 queues behind verl's for one async save (runs on every rank, in order)."""

    def __init__(self, engine, local_path: str, global_step: int, max_ckpt_to_keep, in_handler: bool):
        self.engine, self.local_path, self.global_step = engine, str(local_path), global_step
        self.max_ckpt_to_keep, self.in_handler = max_ckpt_to_keep, in_handler
        self.scheduled = time.perf_counter()

    def __call__(self) -> None:
        _barrier()  # every rank ran Megatron's and verl's finalize functions of this save
        if _rank() == 0:
            t0 = time.perf_counter()
            manifest = write_manifest(self.local_path, global_step=self.global_step)
            self.engine._verl_ds4_manifest_seconds = time.perf_counter() - t0
            what = f"manifest {manifest}"
            if self.in_handler:  # an SFT step folder: its tracker is the run folder's, advanced after the manifest
                _write_tracker(os.path.join(os.path.dirname(os.path.abspath(self.local_path)), TRACKER_NAME),
                               self.global_step)
                what += f"; tracker -> step {self.global_step}"
            print(f"[verl-ds4] async save of step {self.global_step} finalised on every rank "
                  f"{time.perf_counter() - self.scheduled:.2f} s after it was scheduled: {what}", flush=True)
        _barrier()
        rotate(self.engine, self.max_ckpt_to_keep)


def check_async_save_supported() -> None:
    """Raise :class:`AsyncSaveUnsupportedError` unless verl's torchrun SFT trainer drives this process.

    Installs the trainer's end-of-run finalisation (:func:`install_sft_fit_hook`) when it does.
    """
    if install_sft_fit_hook():
        return
    raise AsyncSaveUnsupportedError(
        "verl-ds4: checkpoint async_save=True is supported in verl's torchrun SFT trainer (verl.trainer.sft_trainer) "
        "only: verl 0.9.1's PPO trainer and its Ray workers never finalise Megatron's async saves (nothing calls "
        "maybe_finalize_async_calls), so no step would get its metadata, manifest or tracker and the last save of "
        "the run would be lost. Fix: set async_save=false for this role (RL: actor_rollout_ref.actor.checkpoint."
        "async_save=false and critic.checkpoint.async_save=false; the SFT recipes: ds4.async_save=false; the CPU job: ASYNC_SAVE=0)."
    )


class ManifestCheckpointEngine:
    """Mixin over verl's Megatron engine: a manifest ends every save; loads are verified first."""

    #: Set by :func:`handler_save_checkpoint`: the trainer writes more files, the manifest and rotates itself.
    _verl_ds4_in_handler: bool = False
    _verl_ds4_pending_rotation = None
    _verl_ds4_manifest_seconds = 0.0

    def __init__(self, *args, **kwargs):
        # verl's engines take (model_config, engine_config, optimizer_config, checkpoint_config)
        checkpoint_config = kwargs.get("checkpoint_config", args[3] if len(args) > 3 else None)
        if getattr(checkpoint_config, "async_save", False):
            check_async_save_supported()  # before anything is built
        super().__init__(*args, **kwargs)

    def _device_context(self):
        """The context Megatron's finalisation runs in (the CPU engines': CUDA literals on the CPU)."""
        context = getattr(self, "checkpoint_device_context", None)
        return context() if context is not None else contextlib.nullcontext()

    def finish_async_saves(self, blocking: bool) -> list[int]:
        """Finalise this process's async saves whose writes are done on every rank (``blocking``: wait for all).

        A collective: every rank calls it at the same point (each training step, each save, the end of ``fit``).
        Returns the indices Megatron finalised (empty when none was in flight).
        """
        queue = _async_calls()
        if not queue.get_num_unfinalized_calls():
            return []
        drop = {t: os.devnull for t in getattr(self, "_verl_ds4_verl_trackers", ())}
        with self._device_context(), _module_open(VERL_MANAGER_MODULE, _open_redirected(drop)):
            return queue.maybe_finalize_async_calls(blocking=blocking)

    def train_batch(self, *args, **kwargs):
        if _async_save_on(self):
            self.finish_async_saves(blocking=False)  # a save whose writes are done gets its manifest and tracker now
        return super().train_batch(*args, **kwargs)

    def _save_async(self, local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs):
        self.finish_async_saves(blocking=True)  # one save in flight at a time: the previous one is complete first
        result = super().save_checkpoint(local_path, hdfs_path, global_step, None, **kwargs)  # verl rotates nothing
        trackers = getattr(self, "_verl_ds4_verl_trackers", None)
        if trackers is None:
            trackers = self._verl_ds4_verl_trackers = set()
        # verl's finalize writes this tracker (two levels up) with a plain open: dropped, see the module docstring
        trackers.add(os.path.abspath(os.path.join(os.path.dirname(os.path.dirname(str(local_path))), TRACKER_NAME)))
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        done = _AsyncSaveDone(self, local_path, global_step, max_ckpt_to_keep, self._verl_ds4_in_handler)
        # Megatron finalises requests in order, on every rank once every rank's write is done: this one after verl's.
        with self._device_context():
            _async_calls().schedule_async_request(AsyncRequest(None, (), [done]))
        if _rank() == 0:
            print(f"[verl-ds4] async save of step {global_step} scheduled ({local_path}): its manifest and the "
                  "tracker follow once every rank's write is finalised", flush=True)
        return result

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        writer_queue.install()  # Megatron's writer-results process then ends with this rank (see the module)
        if _async_save_on(self):
            return self._save_async(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
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
        started = time.perf_counter()
        try:
            with _tracker_pending(handler_module) as tracker_of:
                verl_save(self, step)  # shards, data_<dp>.pt, the pending tracker, verl's final barrier
        finally:
            engine._verl_ds4_in_handler = False
        saved_in = time.perf_counter() - started
        if _async_save_on(engine):
            # the shards are still being written: the engine's finalize writes the manifest, tracker, rotation
            if _rank() == 0:
                print(f"[verl-ds4] save of step {step} returned to training after {saved_in:.2f} s (async)", flush=True)
            return
        if _rank() == 0:
            t0 = time.perf_counter()
            manifest = write_manifest(os.path.join(self.default_local_dir, f"global_step_{step}"), global_step=step)
            tracker = tracker_of(self.default_local_dir)
            os.replace(tracker + PENDING_SUFFIX, tracker)
            print(f"[verl-ds4] checkpoint manifest {manifest} written in {time.perf_counter() - t0:.3f} s; "
                  f"tracker -> step {step}; save of step {step} returned to training after {saved_in:.2f} s (sync)",
                  flush=True)
        _barrier()
        rotate(engine, engine._verl_ds4_pending_rotation)

    save_checkpoint.__verl_ds4_hook__ = True
    save_checkpoint.__wrapped__ = verl_save
    return save_checkpoint


def _open_with_pending_tracker(tracker: str):
    """``open`` that writes ``tracker`` under its pending name; every other call is the builtin's."""
    return _open_redirected({tracker: tracker + PENDING_SUFFIX})


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


def sft_fit(verl_fit):
    """verl's ``SFTTrainer.fit`` -> one that finalises the run's async saves (blocking) when it returns.

    The last save of a run is still being written when verl's loop returns; without this, the process group is
    destroyed and the process exits with that save never finalised (no ``.metadata``, manifest or tracker).
    """

    def fit(self, *args, **kwargs):
        result = verl_fit(self, *args, **kwargs)
        finish = getattr(getattr(self, "engine", None), "finish_async_saves", None)
        if finish is not None:
            finish(blocking=True)
        return result

    fit.__verl_ds4_hook__ = True
    fit.__wrapped__ = verl_fit
    return fit


def _sft_trainer_class():
    """verl's ``SFTTrainer`` class of this process: its module, or ``__main__`` under ``python -m`` (None: neither)."""
    for name in (SFT_TRAINER_MODULE, "__main__"):
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is not None and (name == SFT_TRAINER_MODULE or getattr(spec, "name", None) == SFT_TRAINER_MODULE):
            trainer = getattr(module, "SFTTrainer", None)
            if isinstance(trainer, type) and "fit" in trainer.__dict__:
                return trainer
    return None


def install_sft_fit_hook() -> bool:
    """Wrap verl's ``SFTTrainer.fit`` with :func:`sft_fit` (idempotent); False when no SFT trainer drives this process.

    Called by the engine's constructor (which verl's SFT trainer runs in its own ``__init__``, before ``fit``).
    """
    trainer = _sft_trainer_class()
    if trainer is None:
        return False
    if not getattr(trainer.__dict__["fit"], "__verl_ds4_hook__", False):
        trainer.fit = sft_fit(trainer.__dict__["fit"])
    return True


def uninstall_sft_fit_hook() -> None:
    """Put verl's ``SFTTrainer.fit`` back (idempotent; for tests)."""
    trainer = _sft_trainer_class()
    current = trainer.__dict__.get("fit") if trainer is not None else None
    if getattr(current, "__verl_ds4_hook__", False):
        trainer.fit = current.__wrapped__


def uninstall_trainer_hook() -> None:
    """Put verl's ``PPOTrainer._save_checkpoint`` back (idempotent; for tests)."""
    trainer = getattr(sys.modules.get(TRAINER_MODULE), "PPOTrainer", None)
    current = trainer.__dict__.get("_save_checkpoint") if trainer is not None else None
    if getattr(current, "__verl_ds4_hook__", False):
        trainer._save_checkpoint = current.__wrapped__
