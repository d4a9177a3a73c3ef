"""Run a function on N real processes joined in a gloo (or nccl: one GPU each) ``torch.distributed`` group.

Used by the CP tests, the parity harness and benchmarks::

    results = run_distributed(fn, world_size=4, args=(batch,))   # fn(rank, world_size, *args)

Each rank runs ``fn`` after ``init_process_group("gloo")``; the return values come back in rank
order (return plain Python objects: lists, numbers; a tensor sent back from a finished child
process may point at freed shared memory). A failing rank raises :class:`DistributedRunError` in the caller with that rank's traceback;
a hang is killed after ``timeout`` seconds. Processes are forked by default (cheap: verl and
megatron stay imported; each first holds on to the parent's Megatron groups, see
:func:`keep_inherited_groups`), each limited to one intra-op thread; pass ``start_method="spawn"`` for a
clean interpreter (then ``fn`` must be importable by name).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


class DistributedRunError(RuntimeError):
    """A rank of :func:`run_distributed` failed or timed out."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (rendezvous of gloo groups and torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Process groups a forked rank inherited from its parent, held for the rank's lifetime (see below).
_INHERITED_GROUPS: list[Any] = []


def keep_inherited_groups() -> int:
    """In a forked rank: hold a reference to every process group it inherited through Megatron's parallel
    state; returns how many.

    ``initialize_model_parallel`` reassigns those globals. Dropping the parent's last reference in the child
    runs ``ProcessGroupGloo``'s destructor there, which joins the parent's gloo threads, which a forked
    child does not have: the rank hangs in silence. Any in-process Megatron use in the parent leaves such
    groups behind (megatron-core 0.16.1's ``destroy_model_parallel`` keeps
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo twin), so every forked rank calls this first.
    """
    import sys

    state = sys.modules.get("megatron.core.parallel_state")
    if state is None:  # a spawned rank, or a parent that never imported Megatron
        return 0
    from torch.distributed import ProcessGroup

    before = len(_INHERITED_GROUPS)
    for value in list(vars(state).values()):
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        _INHERITED_GROUPS.extend(item for item in items if isinstance(item, ProcessGroup))
    return len(_INHERITED_GROUPS) - before


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, queue, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    keep_inherited_groups()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank, chosen before the group exists
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, True, result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    start_method: str = "fork",
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    ``backend="nccl"``: each rank first selects GPU ``rank`` (``torch.cuda.set_device``); pass
    ``start_method="spawn"`` (a CUDA context does not survive a fork: ``"fork"`` is refused)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: run_distributed runs 'gloo' (CPU) or 'nccl' (one GPU per rank) groups.")
    if backend == "nccl" and start_method == "fork":
        raise ValueError(
            f"backend='nccl' with start_method={start_method!r}: the nccl ranks use CUDA, and a CUDA context does not "
            "survive a fork (a parent that touched CUDA leaves the ranks unusable). Expected start_method='spawn' "
            "(then fn must be importable by name): run_distributed(fn, ..., backend='nccl', start_method='spawn')."
        )
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, kwargs or {}, queue, backend), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedRunError(
                    f"{world_size - len(results) - len(failures)} of {world_size} ranks did not finish within "
                    f"{timeout:.0f} s (a hang in a collective?)." + ("\n" + "\n".join(failures) if failures else "")
                )
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not failures:
                    # A rank died without reporting (killed, segfault): do not wait for the timeout.
                    codes = ", ".join(f"rank {procs.index(p)} exit code {p.exitcode}" for p in dead)
                    raise DistributedRunError(f"ranks died without a result: {codes}.")
                continue
            if ok:
                results[rank] = payload
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                # Other ranks may now block in a collective: give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
        if failures:
            raise DistributedRunError("\n".join(failures))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
