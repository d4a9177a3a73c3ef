"""Megatron's checkpoint-writer results queue, served by a process that ends with its rank.

Megatron-Core's ``torch_dist`` save (``FileSystemWriterAsync``, used for synchronous saves too) collects its
writers' results through a queue served by a :mod:`multiprocessing` manager process. Megatron spawns that
process on a rank's first save (``filesystem_async``'s ``get_write_results_queue``, cached in the module's
``_results_queue``) and nothing ties it to the rank: when the rank is killed (SIGKILL, a node-local
``kill``, or a SIGTERM from ``scancel`` / torchrun, which skips Python's exit handlers) the manager and
the ``resource_tracker`` beside it stay alive, orphaned, one pair per rank, holding the launcher's
output pipe open. Under Slurm's ``proctrack/linuxproc`` they even outlive the job.

:func:`install` (called by :class:`verl_ds4.engine.checkpoint.ManifestCheckpointEngine` before each save)
fills that cache first with a queue of a manager started with :func:`_exit_with_parent` as its
initializer: a daemon thread in the manager process that ends the process within :data:`POLL_S`
seconds of its rank's death (its parent process id changes when it is orphaned). The resource
tracker then exits by itself (its last writer is gone). The queue is Megatron's own kind (a
``SyncManager().Queue()``), so Megatron's save path is unchanged. A Megatron without that cache
(a renamed global) is left alone.

The manager is started with ``spawn`` (as Megatron's is) but without running the rank's main module again in it
(:func:`_main_module_not_run`): ``spawn`` imports the parent's ``__main__`` in the child, for a rank
``verl.trainer.sft_trainer`` with verl, Megatron and the engines, about 10 s of imports on a CPU (and their memory)
at every run's first save, for a process that serves one queue from the standard library.

Each writer gets a queue of its own from that manager (:func:`_queue_per_writer` in place of
``filesystem_async.get_write_results_queue``, ``_get_write_results_queue`` before Megatron-Core 0.19, which hands
every writer the one cached queue). verl saves a
checkpoint as three dist-checkpoint saves (``model/``, ``optimizer/``, ``extra/``); with ``async_save`` their
forked writers run at the same time and put their results into that queue in the order they finish, while
Megatron's finalisation takes them in the order the saves were scheduled (``results_queue.get_nowait()``):
the model save's finalisation then takes the ``extra`` writer's results and fails with "Incomplete worker
results (expected 2, got 1)" (seen on the CPU job). Synchronous saves write one at a time and are unchanged.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.spawn
import os
import threading
import time
from multiprocessing.managers import SyncManager

__all__ = ["POLL_S", "install"]

#: How often the manager process checks that its rank is alive (seconds).
POLL_S = 0.5

_MANAGER: SyncManager | None = None


def _exit_with_parent(parent: int, poll_s: float = POLL_S) -> None:
    """Runs in the manager process: end it (``os._exit``) once its parent ``parent`` is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="verl-ds4-exit-with-rank", daemon=True).start()


@contextlib.contextmanager
def _main_module_not_run():
    """While it lasts, processes started with ``spawn`` do not import the parent's main module (the preparation
    data a spawned child receives loses ``init_main_from_name`` / ``init_main_from_path``); everything else they
    get as usual (``sys.path``, the working folder, the authkey). Only for a child that needs nothing of it."""
    prepare = multiprocessing.spawn.get_preparation_data

    def without_main(name):
        data = prepare(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    multiprocessing.spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = prepare


def install() -> SyncManager | None:
    """Give Megatron's writer a results queue whose manager process ends with this process.

    Returns the manager (started here, or by an earlier call), or ``None`` when Megatron had already made
    its own queue or has no such cache (nothing is changed then)."""
    global _MANAGER
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return None
    if _MANAGER is not None:
        return _MANAGER
    if getattr(filesystem_async, "_results_queue", False) is not None:
        return None
    manager = SyncManager(ctx=mp.get_context("spawn"))
    with _main_module_not_run():  # it serves a queue: the rank's main module (verl's trainer) is not imported there
        manager.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    for name in ("get_write_results_queue", "_get_write_results_queue"):  # Megatron-Core 0.19 and dev / 0.16
        if callable(getattr(filesystem_async, name, None)):
            setattr(filesystem_async, name, _queue_per_writer)
    _MANAGER = manager
    return manager


def _queue_per_writer(*_args, **_kwargs):
    """Megatron's ``get_write_results_queue`` (``_get_write_results_queue`` before 0.19) with one queue per writer,
    from the manager that ends with this rank (see the module docstring); Megatron's ``mp_mode`` is the manager's."""
    return _MANAGER.Queue()
