"""Per-rank row tables of a THD plan (internal to :mod:`.plan`).

A CP rank's local rows are described by *runs*, one per (sequence, chunk) the rank holds
(contiguous layout: one chunk per sequence; zigzag: two), computed on the host in NumPy from the
plan's padded cumulative lengths (:func:`rank_runs`). :func:`build_tables` turns them into the
device tables packing uses (segment of each row, flat source token, padding mask) with one
host-to-device copy per rank; :func:`wrap_rows`, :func:`source_shift` and :func:`rank_rows` add the
label-shift and descriptive tables on first use. All sizes are in rows; every table is int64
unless named otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .types import CPLayout

class RankRows(NamedTuple):
    """Per local row of one CP rank (``[local_rows]`` int64 tensors; ``valid`` and
    ``keep_position`` are bool). A descriptive view for tools and tests; packing does not need it.

    ``slot``: buffer slot of the row's sequence; ``position``: padded position inside it;
    ``source``: flat token index (meaningful where ``valid``); ``seqlen``: real length of the
    row's sequence; ``valid``: a real token (not padding); ``keep_position``: zigzag only, rows
    of the first chunk (verl keeps their running position on padding).
    """

    slot: torch.Tensor
    position: torch.Tensor
    source: torch.Tensor
    seqlen: torch.Tensor
    valid: torch.Tensor
    keep_position: torch.Tensor | None


_ARANGE_CACHE: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` int64, a read-only view of a cached, growing buffer (one per device).

    Every rank table adds the row index; computing it is a full pass over the rows. Callers
    never write to the result.
    """
    cached = _ARANGE_CACHE.get(device)
    if cached is None or cached.shape[0] < n:
        cached = torch.arange(max(n, 1024, 2 * (0 if cached is None else cached.shape[0])), device=device)
        _ARANGE_CACHE[device] = cached
    return cached[:n]


# Added to a segment's value where its rows must come out negative (padding sources, zeroed
# positions): far below any row index, far above int64's minimum.
_NEGATIVE = -(2**62)


class _RankTables:
    """Row tables of one CP rank, built from per-*segment* values (internal).

    A rank's rows are runs, one per (sequence, chunk) it holds (contiguous: one chunk per
    sequence, zigzag: two), and each run splits into a segment of real rows followed by a
    segment of padding rows: segment ``2 * run`` is real, ``2 * run + 1`` padding. Inside a
    segment the source token and the position grow by one per row, so a row table is a
    per-segment value gathered by ``seg`` plus the row index. Rows that must not keep a value
    (padding sources; positions verl zeroes) get :data:`_NEGATIVE` added to their segment's
    value and are clamped to 0, so the padding mask and the zeroed positions cost no extra
    gather. The per-run host arrays stay for the tables built on first use (labels,
    :class:`RankRows`).
    """

    __slots__ = (
        "seg", "source", "pad", "seg_position", "zeroed_positions", "runs", "_source_shift", "_wrap", "_rank_rows"
    )

    def __init__(self, seg, source, pad, seg_position, zeroed_positions, runs):
        self.seg = seg  # [L] int64: segment of each row
        self.source = source  # [L] int64: flat source token (0 on padding rows)
        self.pad = pad  # [L] bool: padding rows, or None when the rank has none
        self.seg_position = seg_position  # [S] int64: position of row j of a segment is j + this (< 0: zeroed)
        self.zeroed_positions = zeroed_positions  # whether any row's position is zeroed
        self.runs = runs  # host (NumPy) per-run arrays: slot, local_start, pos0, real, seqlen, token_start
        self._source_shift = None
        self._wrap = None
        self._rank_rows = None


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (shares memory on the CPU: pass an array nobody
    else writes, or a copy).

    On CUDA the array goes through pinned memory and is copied with ``non_blocking=True``:
    asynchronous, with no stream synchronisation (a blocking copy, or one from pageable memory,
    may synchronise the stream); PyTorch's caching host allocator keeps the pinned block until
    the copy has run.
    """
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def rank_runs(
    layout: CPLayout,
    cp_size: int,
    cp_rank: int,
    local_rows: int,
    cu_padded: np.ndarray,
    padded: np.ndarray,
    seqlens: np.ndarray,
    token_starts: np.ndarray,
) -> dict[str, np.ndarray]:
    """Host per-run arrays of ``cp_rank``: which rows of which sequence it holds.

    ``cu_padded`` ``[B + 1]``, ``padded``, ``seqlens`` and ``token_starts`` ``[B]`` are host int64
    arrays in buffer order. Keys: ``slot``, ``local_start`` (first local row of the run),
    ``pos0`` (padded position of that row inside its sequence), ``seqlen``, ``token_start``,
    ``count`` (rows of the run) and ``real`` (its leading real rows).
    """
    rows = local_rows
    starts, ends = cu_padded[:-1], cu_padded[1:]
    if layout is CPLayout.CONTIGUOUS or cp_size == 1:
        # one run per slot overlapping the window [w0, w0 + rows): the slots lo .. hi - 1
        w0 = cp_rank * rows
        lo = int(np.searchsorted(ends, w0, side="right"))
        hi = max(lo, int(np.searchsorted(starts, w0 + rows, side="left")))
        starts, ends = starts[lo:hi], ends[lo:hi]
        first = np.maximum(starts, w0)
        count = np.minimum(ends, w0 + rows) - first
        runs = dict(slot=np.arange(lo, hi), local_start=first - w0, pos0=first - starts,
                    seqlen=seqlens[lo:hi], token_start=token_starts[lo:hi])
    else:
        # run 2s + c = chunk c of sequence s (c = 0: chunk cp_rank, c = 1: chunk 2cp-1-cp_rank),
        # at local rows [starts/cp + c*half, + half)
        cp = cp_size
        half = padded // (2 * cp)
        base = starts // cp
        count = np.repeat(half, 2)
        batch_size = padded.shape[0]
        runs = dict(
            slot=np.repeat(np.arange(batch_size), 2),
            local_start=np.stack([base, base + half], 1).ravel(),
            pos0=np.stack([cp_rank * half, (2 * cp - 1 - cp_rank) * half], 1).ravel(),
            seqlen=np.repeat(seqlens, 2),
            token_start=np.repeat(token_starts, 2),
        )
    runs["count"] = count
    runs["real"] = np.minimum(np.maximum(runs["seqlen"] - runs["pos0"], 0), count)
    return runs


def build_tables(
    runs: dict[str, np.ndarray], layout: CPLayout, cp_size: int, local_rows: int, device: torch.device
) -> _RankTables:
    """The row tables of one rank from its :func:`rank_runs` (see :class:`_RankTables`)."""
    local_start, pos0, real = runs["local_start"], runs["pos0"], runs["real"]
    segment = np.empty((3, 2 * real.shape[0]), dtype=np.int64)
    segment[0, 0::2], segment[0, 1::2] = real, runs["count"] - real  # rows per segment
    # source of row j: token_start + pos0 + (j - local_start) on real rows, negative on padding
    segment[1, 0::2] = runs["token_start"] + pos0 - local_start
    segment[1, 1::2] = _NEGATIVE
    # position of row j: pos0 + (j - local_start); on padding 0, except that verl 0.9.1 keeps
    # the running position on the padding rows of a zigzag rank's first chunk
    segment[2, 0::2] = segment[2, 1::2] = pos0 - local_start
    # zeroed: every padding segment (contiguous), the second chunk's (zigzag, segment 4s + 3)
    zeroed = np.s_[1::2] if layout is CPLayout.CONTIGUOUS or cp_size == 1 else np.s_[3::4]
    segment[2, zeroed] += _NEGATIVE
    # ranks without padding rows (common with zigzag) skip the masks: decided on the host
    has_padding = bool(segment[0, 1::2].any())
    zeroed_positions = bool(segment[0, zeroed].any())
    segment = host_to_device(segment, device)  # the rank's one host-to-device copy
    rows = local_rows
    seg = torch.repeat_interleave(segment[0], output_size=rows)
    source = segment[1].index_select(0, seg).add_(_arange(rows, device))
    pad = None
    if has_padding:
        pad = source < 0
        source.clamp_(min=0)
    return _RankTables(seg, source, pad, segment[2], zeroed_positions, runs)


def wrap_rows(tables: _RankTables, local_rows: int, device: torch.device) -> torch.Tensor:
    """``[2, R]``: row of each run's sequence's last real token (``local_rows`` where the run
    does not hold it) and that sequence's first token (the last token's label)."""
    if tables._wrap is None:
        runs = tables.runs
        last = runs["seqlen"] - 1 - runs["pos0"]  # relative to the run's first row
        on = (last >= 0) & (last < runs["real"])
        wrap = np.stack([np.where(on, runs["local_start"] + last, local_rows), runs["token_start"]])
        tables._wrap = host_to_device(wrap, device)
    return tables._wrap


def source_shift(tables: _RankTables, local_rows: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[L]`` int64: source of each row's label (next token; the last token wraps to the first)."""
    if tables._source_shift is None:
        buffer = torch.empty(local_rows + 1, dtype=torch.long, device=device)
        shifted = buffer[:local_rows]
        torch.add(tables.source, 1, out=shifted)
        if num_tokens < 2:  # padding rows read token 1
            shifted.clamp_(max=max(num_tokens - 1, 0))
        wrap = wrap_rows(tables, local_rows, device)
        buffer.index_copy_(0, wrap[0], wrap[1])  # the extra row absorbs runs without a last token
        tables._source_shift = shifted
    return tables._source_shift


def rank_rows(
    tables: _RankTables,
    layout: CPLayout,
    cp_size: int,
    local_rows: int,
    seqlens: np.ndarray,
    token_starts: np.ndarray,
    device: torch.device,
) -> RankRows:
    """:class:`RankRows` of one rank (cached on ``tables``); ``seqlens`` / ``token_starts``: host,
    buffer order."""
    if tables._rank_rows is None:
        seg, runs = tables.seg, tables.runs
        slot = host_to_device(np.repeat(runs["slot"], 2), device).index_select(0, seg)
        position = host_to_device(np.repeat(runs["pos0"] - runs["local_start"], 2), device).index_select(0, seg)
        position.add_(_arange(local_rows, device))
        source = position + host_to_device(token_starts, device).index_select(0, slot)
        seqlen = host_to_device(seqlens, device).index_select(0, slot)
        keep = None
        if not (layout is CPLayout.CONTIGUOUS or cp_size == 1):
            keep = host_to_device(np.arange(4 * seqlens.shape[0]) % 4 < 2, device).index_select(0, seg)  # chunk 0
        valid = torch.ones_like(seg, dtype=torch.bool) if tables.pad is None else ~tables.pad
        tables._rank_rows = RankRows(slot, position, source, seqlen, valid, keep)
    return tables._rank_rows
