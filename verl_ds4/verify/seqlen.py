"""``verl-ds4 verify --seq-len N``: CP parity at length, and the indexer replay inside verify.

**The batch** (:func:`long_lengths`): one sequence of ``N`` tokens, the longest of the batch, with short
ones beside it (:data:`SHORT_BESIDE`, each clipped to ``N``): two before it, so that the long sequence
starts in the middle of rank 0's rows, and three after it, so that it ends in the middle of the last
rank's. At CP 8 and ``N`` = 32k every rank holds about 4k rows of the long sequence, so

* the long sequence is spread over every rank, and each rank but the first runs the halo exchange in
  the middle of it (its left neighbour's last window / compression rows belong to the same sequence);
* its compressed blocks (ratio 4 and 128) are all-gathered, and a query's top-k blocks (the indexer
  chooses among all blocks of its sequence so far) lie on several ranks before its own;
* the linear sparse core (``--sparse-core linear``) splits each rank's rows into several row chunks,
  so chunk boundaries fall inside the long sequence.

**Bad input** (:func:`check_seq_len`): ``N < 2`` (a sequence needs a next-token label) and, at CP > 1, an
``N`` too short to cross a rank boundary (below ``cp x min_local_rows``: every rank is padded to the model's
minimum rows, and the long sequence would fit in one rank) are refused with the smallest ``N`` that works.

**Indexer replay** (``--indexer-replay on | both``; batch names ending in :data:`REPLAY_SUFFIX`): before the
training step the actor runs a no-grad forward of the same batch and plan with every selecting layer
recording its choice (:mod:`verl_ds4.mcore.indexer_replay`: ids per local row, as the rollout records
them), and the training step then replays those ids in place of its own top-k, exactly the path the
engine takes with ``actor_rollout_ref.actor.megatron.indexer_replay=true``. Its negative control replays
another valid choice (the first ``index_topk`` blocks of each row that reaches more than that): the
log-probs must then differ from the reference's.
"""

from __future__ import annotations

import torch

__all__ = [
    "LINEAR_CHUNK_ROWS",
    "QUERY_CHUNK_ROWS",
    "REPLAY_SUFFIX",
    "SHORT_BESIDE",
    "first_blocks",
    "long_lengths",
    "record_and_load",
    "replaying_other_blocks",
    "replay_batches",
    "check_seq_len",
    "fit_positions",
    "bound_malloc",
]

#: The short sequences around the long one: (before, before, after, after, after).
SHORT_BESIDE = (5, 300, 37, 129, 3)
#: ``--seq-len`` with ``--sparse-core linear``: the core's query rows per chunk (its default, sized by a 256 MiB
#: budget, is about 20k rows at the tiny widths: one chunk per rank), so that chunk boundaries fall inside the
#: long sequence on every rank (not a divisor of a rank's rows).
LINEAR_CHUNK_ROWS = 384
#: ``--seq-len`` at CP > 1: the attention's query rows per chunk of its compressed-block work (scores, top-k, masks,
#: the dense core, the indexer loss; :mod:`verl_ds4.models.query_chunks`; V4.1: :mod:`verl_ds4.models.ds41.csa2_rows`),
#: so that row-chunk boundaries fall inside the long sequence on every rank while the CP 1 reference runs its own
#: (budget-sized) chunks.
QUERY_CHUNK_ROWS = 160
#: A batch name with this suffix runs the training step with the indexer's recorded choices replayed.
REPLAY_SUFFIX = "+replay"


def long_lengths(n: int) -> tuple[int, ...]:
    """The ``--seq-len n`` batch: ``n`` tokens between short sequences (each at most ``n``)."""
    a, b, c, d, e = (min(s, n) for s in SHORT_BESIDE)
    return (a, b, n, c, d, e)


def check_seq_len(n: int, cp: int, min_local_rows: int) -> None:
    """Refuse (``ValueError``) ``--seq-len n`` at ``--cp cp`` with a model of ``min_local_rows`` that cannot run."""
    if n < 2:
        raise ValueError(f"--seq-len {n}: expected N >= 2 (every token but a sequence's last needs a next-token label); give --seq-len 2 or more")
    floor = cp * min_local_rows
    if cp > 1 and n < floor:
        raise ValueError(
            f"--seq-len {n} at --cp {cp}: the longest sequence must cross a CP rank boundary, and every rank is padded to "
            f"the model's {min_local_rows} minimum rows, so expected N >= cp x min_local_rows = {floor}; give --seq-len "
            f"{floor} or more, or a smaller --cp"
        )


def fit_positions(n: int, cfg: dict, given: bool, flag: str = "--config") -> tuple[dict, str | None]:
    """``(config, note)`` for ``--seq-len n``: a model config whose ``max_position_embeddings`` is below ``n`` is
    refused when the user gave it (``given``: their setting is theirs to change); the built-in tiny model's (4,096,
    a size of our choosing, not a property of DS4, whose released models take 1M positions) is raised to ``n`` for
    the run, with a note saying so. RoPE's numbers do not read the field (YaRN reads its own original length)."""
    limit = cfg.get("max_position_embeddings")
    if not limit or n <= int(limit):
        return cfg, None
    if given:
        raise ValueError(
            f"--seq-len {n}: the model of {flag} has max_position_embeddings = {limit}, expected N <= {limit}; give "
            f"--seq-len {limit} or less, or a config with max_position_embeddings >= {n}"
        )
    note = (f"max_position_embeddings of the tiny model raised from {limit} to {n} for this run (--seq-len {n}; the "
            "field bounds positions only, no weight or RoPE value reads it)")  # fmt: skip
    return {**cfg, "max_position_embeddings": int(n)}, note


def bound_malloc(threshold: int = 128 * 1024) -> bool:
    """Make glibc serve every allocation above ``threshold`` bytes by ``mmap`` (returned to the system when freed),
    so that the row chunks' many transient ``[chunk, blocks]`` buffers do not fragment the heap: without it a
    process's RSS at 16k tokens grows to several times what it holds. Inherited by forked CP ranks; ``False``
    where there is no glibc (nothing changes there)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD (a fixed value turns the dynamic one off)
    except (OSError, AttributeError):
        return False


def replay_batches(batches: dict[str, tuple[int, ...]], mode: str) -> dict[str, tuple[int, ...]]:
    """``batches`` for ``--indexer-replay mode``: ``off`` as given, ``on`` replayed only, ``both`` each twice."""
    if mode not in ("off", "on", "both"):
        raise ValueError(f"--indexer-replay {mode!r}: expected off, on or both.")  # error-catalogue: internal: argparse restricts the choices
    out = {} if mode == "on" else dict(batches)
    if mode != "off":
        out.update({f"{name}{REPLAY_SUFFIX}": lengths for name, lengths in batches.items()})
    return out


def record_and_load(model, forward, alter=None) -> torch.Tensor:
    """Record ``model``'s indexer choices in a no-grad ``forward()`` and load them (``alter(ids)`` first, when
    given) as the replay target of the next forward; returns the recorded ``[local_rows, layers, k]`` ids."""
    from verl_ds4.mcore import indexer_replay

    indexer_replay.enable(model, record=True)
    indexer_replay.load(model, None)
    with torch.no_grad():
        forward()
    ids = indexer_replay.recorded(model)
    indexer_replay.load(model, ids if alter is None else alter(ids))
    indexer_replay.enable(model, record=False)
    return ids


def first_blocks(ids: torch.Tensor) -> torch.Tensor:
    """Another valid choice than ``ids`` ``[rows, layers, k]``: a row that reaches more than ``k`` blocks (all ``k``
    ids set) takes blocks ``0..k-1``; a row that reaches fewer keeps its ids (it chooses all it reaches)."""
    full = (ids >= 0).all(dim=-1, keepdim=True)
    first = torch.arange(ids.shape[-1], dtype=ids.dtype, device=ids.device).expand_as(ids)
    return torch.where(full, first, ids)


def replaying_other_blocks(model, forward, step):
    """The negative control: ``step()`` (no grad) replaying :func:`first_blocks` of the choices ``forward()`` records."""
    record_and_load(model, forward, alter=first_blocks)
    try:
        with torch.no_grad():
            return step()
    finally:
        stop_replay(model)


def stop_replay(model) -> None:
    """Forget the loaded targets (the next forward chooses natively)."""
    from verl_ds4.mcore import indexer_replay

    indexer_replay.forget_targets(model)


def use_linear_chunk_rows(rows: int) -> None:
    """Make the DS4 attention's linear core (this process only: a forked CP rank) run ``rows`` query rows per chunk."""
    import functools

    from verl_ds4.models.ds4 import csa_rows

    csa_rows.linear_sparse_attn = functools.partial(csa_rows.linear_sparse_attn, chunk_rows=int(rows))


def use_query_chunk_rows(model, rows: int) -> int:
    """Make every attention of ``model`` with row chunks (``query_chunk_rows``) run ``rows`` query rows per chunk;
    returns how many modules took it."""
    count = 0
    for module in model.modules():
        if hasattr(module, "query_chunk_rows"):
            module.query_chunk_rows = int(rows)
            count += 1
    return count
