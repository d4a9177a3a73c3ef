"""The THD plan: padding and CP row ownership for one micro-batch, computed once.

A plan is built from the sequence lengths of a micro-batch and :class:`PlanOptions`. It fixes

* the padded length of every sequence and the global padded buffer of ``total_rows`` rows
  (``cu_seqlens_padded``, identical on every CP rank),
* which ``local_rows = total_rows // cp`` rows each CP rank owns (see :mod:`.types`),
* for a rank: its gather index (local row -> flat source token, ``-1`` for padding), position
  ids, and the label-shift index (local row -> source token of the *next* position),
* for the whole group: where each source token lives after an all-gather, so per-token outputs
  are put back in the original order with one ``index_select``.

There is no Python loop over sequences. Per-sequence arithmetic (padding, which part of each
sequence a rank holds) runs on the host in vectorised NumPy, on the lengths fetched with the
plan's single device-to-host transfer; per-row tables are built on the lengths' device from a few
per-segment values (one host-to-device copy per rank) with a handful of full-width tensor ops.
Padding rules live with the options (:mod:`.options`); the per-rank row tables in :mod:`.tables`.

Label shift (``shift=True``): the label of position ``p`` of a sequence of length ``n`` is the
token at position ``(p + 1) % n`` of the *same* sequence. The last token's label wraps to the
sequence's first token (it is masked by the loss mask), never to the next sequence or padding.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
import torch

from .balance import balanced_host_order
from .options import PlanOptions
from .tables import RankRows, _arange, _RankTables, build_tables, host_to_device, rank_runs, source_shift, wrap_rows
from .tables import rank_rows as rank_rows_of
from .types import CPLayout

__all__ = [
    "PlanOptions", "RankRows", "THDPlan", "build_plan", "check_order_agreement", "order_digest", "plan_from_offsets",
    "plan_from_padded_lengths",
]


class THDPlan:
    """Padding and CP ownership of one micro-batch. Build it with :func:`build_plan`.

    Tensors (on the device of the lengths; ``B`` sequences, ``T`` real tokens):

    * ``seqlens`` ``[B]`` int64, original order; ``token_offsets`` ``[B + 1]`` int64, where each
      sequence starts in the flat token tensor (``values()`` of a jagged input).
    * ``order`` ``[B]``: buffer slot ``k`` holds sequence ``order[k]`` (``None``: identity).
    * ``seqlens_padded`` ``[B]`` int64, buffer order.
    * ``cu_seqlens`` / ``cu_seqlens_padded`` ``[B + 1]`` int32: real / padded cumulative lengths in
      buffer order, global (identical on every rank).

    Python ints: ``batch_size``, ``num_tokens``, ``total_rows``, ``local_rows``, ``max_seqlen_padded``.
    """

    def __init__(
        self,
        options: PlanOptions,
        device: torch.device,
        host_seqlens: np.ndarray,
        host_order: np.ndarray | None,
        host_padded: np.ndarray,
        seqlens: torch.Tensor | None = None,
        order: torch.Tensor | None = None,
        token_offsets: torch.Tensor | None = None,
    ) -> None:
        self.options = options
        self.layout = options.layout
        self.cp_size = options.cp_size
        self._seqlens = seqlens
        self.order = order
        self._h_order = host_order
        self.batch_size = int(host_seqlens.shape[0])
        self._device = device
        # host (NumPy int64) copies, buffer order unless named otherwise
        self._h_offsets = np.zeros(self.batch_size + 1, dtype=np.int64)
        np.cumsum(host_seqlens, out=self._h_offsets[1:])
        if host_order is None:
            self._h_seqlens, self._h_token_starts = host_seqlens, self._h_offsets[:-1]
        else:
            self._h_seqlens, self._h_token_starts = host_seqlens[host_order], self._h_offsets[:-1][host_order]
        self._h_padded = host_padded
        self._h_cu_padded = np.zeros(self.batch_size + 1, dtype=np.int64)
        np.cumsum(host_padded, out=self._h_cu_padded[1:])

        self.num_tokens = int(self._h_offsets[-1])
        self.total_rows = int(self._h_cu_padded[-1])
        self.local_rows = self.total_rows // options.cp_size
        self.max_seqlen_padded = int(host_padded.max())
        self.cu_seqlens_padded = self._to_device(self._h_cu_padded.astype(np.int32))
        self._token_offsets = token_offsets
        self._cu_seqlens: torch.Tensor | None = None
        self._seqlens_padded: torch.Tensor | None = None
        self._tables_cache: dict[int, _RankTables] = {}
        self._token_rows: torch.Tensor | None = None

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the plan's device (see :func:`.tables.host_to_device`)."""
        return host_to_device(array, self._device)

    @property
    def host_seqlens(self) -> np.ndarray:
        """``[B]`` int64 NumPy lengths in original order: the host copy of the plan's one transfer
        (read-only; costs nothing)."""
        lengths = self._h_offsets[1:] - self._h_offsets[:-1]
        lengths.flags.writeable = False
        return lengths

    @property
    def seqlens(self) -> torch.Tensor:
        if self._seqlens is None:
            self._seqlens = self._to_device(self._h_offsets[1:] - self._h_offsets[:-1])
        return self._seqlens

    @property
    def token_offsets(self) -> torch.Tensor:
        if self._token_offsets is None:
            self._token_offsets = self._to_device(self._h_offsets.copy())
        return self._token_offsets

    @property
    def seqlens_padded(self) -> torch.Tensor:
        if self._seqlens_padded is None:
            self._seqlens_padded = self._to_device(self._h_padded.copy())
        return self._seqlens_padded

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[B + 1]`` int32: cumulative real lengths in buffer order."""
        if self._cu_seqlens is None:
            cu = np.zeros(self.batch_size + 1, dtype=np.int32)
            np.cumsum(self._h_seqlens, out=cu[1:])
            self._cu_seqlens = self._to_device(cu)
        return self._cu_seqlens

    def _check_rank(self, cp_rank: int) -> None:
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {cp_rank}.")

    def _runs(self, cp_rank: int) -> dict[str, np.ndarray]:
        """Host per-run arrays of ``cp_rank``: which rows of which sequence it holds (:func:`.tables.rank_runs`)."""
        return rank_runs(self.layout, self.cp_size, cp_rank, self.local_rows, self._h_cu_padded, self._h_padded,
                         self._h_seqlens, self._h_token_starts)

    def _tables(self, cp_rank: int) -> _RankTables:
        """The row tables of ``cp_rank`` (cached per rank); see :class:`.tables._RankTables`."""
        self._check_rank(cp_rank)
        tables = self._tables_cache.get(cp_rank)
        if tables is None:
            tables = build_tables(self._runs(cp_rank), self.layout, self.cp_size, self.local_rows, self._device)
            self._tables_cache[cp_rank] = tables
        return tables

    def _wrap(self, tables: _RankTables) -> torch.Tensor:
        return wrap_rows(tables, self.local_rows, self._device)

    def _source_shift(self, tables: _RankTables) -> torch.Tensor:
        return source_shift(tables, self.local_rows, self.num_tokens, self._device)

    def rank_rows(self, cp_rank: int) -> RankRows:
        """What each of ``cp_rank``'s local rows holds (cached per rank)."""
        return rank_rows_of(self._tables(cp_rank), self.layout, self.cp_size, self.local_rows, self._h_seqlens,
                            self._h_token_starts, self._device)

    def gather_index(self, cp_rank: int, shift: bool = False) -> torch.Tensor:
        """``[local_rows]`` int64: flat source token of each local row (``-1`` on padding rows).

        With ``shift=True`` the source is the next position of the same sequence (the label).
        """
        tables = self._tables(cp_rank)
        source = self._source_shift(tables) if shift else tables.source
        return source.clone() if tables.pad is None else source.masked_fill(tables.pad, -1)

    def position_ids(self, cp_rank: int, shift: bool = False) -> torch.Tensor:
        """``[local_rows]`` int64: position inside its sequence of each local row's source token.

        Padding rows get 0 (zigzag first-chunk padding rows keep their padded position, as in verl).
        With ``shift=True``: the position of the label token, ``(p + 1) % n``.
        """
        tables = self._tables(cp_rank)
        seg, rows, device = tables.seg, self.local_rows, self._device
        if shift:
            buffer = torch.empty(rows + 1, dtype=torch.long, device=device)
            position = buffer[:rows]
            torch.index_select(tables.seg_position, 0, seg, out=position)
            position.add_(_arange(rows, device)).add_(1)
            if tables.pad is not None:
                position.masked_fill_(tables.pad, 0)
            buffer.index_fill_(0, self._wrap(tables)[0], 0)  # the last token's label is the first token
            return position
        position = tables.seg_position.index_select(0, seg).add_(_arange(rows, device))
        return position.clamp_(min=0) if tables.zeroed_positions else position

    def global_start(self, cp_rank: int) -> int:
        """First global buffer row of ``cp_rank`` (contiguous layout only)."""
        if self.layout is not CPLayout.CONTIGUOUS and self.cp_size > 1:
            raise ValueError("global_start is defined for the contiguous layout only; zigzag ranks own two chunks.")
        self._check_rank(cp_rank)
        return cp_rank * self.local_rows

    # ------------------------------------------------------------------ pack / unpack
    def pack(self, values: torch.Tensor, cp_rank: int, shift: bool = False, fill=0) -> torch.Tensor:
        """Rows of ``cp_rank`` from a flat per-token tensor ``values`` ``[T, ...]`` (original order).

        Works for any trailing shape (``[T]`` ids, ``[T, k]`` router routes, ``[T, h]`` hidden
        states). Padding rows are ``fill``. ``shift=True`` packs labels (see the module docstring).
        """
        if values.dim() == 0 or values.shape[0] != self.num_tokens:
            raise ValueError(
                f"pack expects a flat per-token tensor with {self.num_tokens} rows (the plan's tokens), "
                f"got shape {tuple(values.shape)}. Pass a jagged tensor's values()."
            )
        if self.num_tokens == 0:
            return values.new_full((self.local_rows, *values.shape[1:]), fill)
        tables = self._tables(cp_rank)
        source = self._source_shift(tables) if shift else tables.source
        out = values.index_select(0, source)
        if tables.pad is None:
            return out
        return out.masked_fill_(tables.pad.view(-1, *([1] * (values.dim() - 1))), fill)

    def token_rows(self) -> torch.Tensor:
        """``[T]`` int64: row of each source token in the rank-ordered concatenation of all ranks."""
        if self._token_rows is not None:
            return self._token_rows
        # per (sequence, chunk) segments of consecutive tokens landing on consecutive rows
        seqlens = self._h_offsets[1:] - self._h_offsets[:-1]  # original order
        slot = np.arange(self.batch_size) if self._h_order is None else np.argsort(self._h_order)
        start = self._h_cu_padded[:-1][slot]  # first buffer row of each sequence
        token_start = self._h_offsets[:-1]
        if self.layout is CPLayout.CONTIGUOUS or self.cp_size == 1:
            counts, delta = seqlens, start - token_start
        else:
            cp = self.cp_size
            half = (self._h_padded[slot] // (2 * cp))[:, None]
            chunk = np.arange(2 * cp)[None, :]
            counts = np.clip(seqlens[:, None] - chunk * half, 0, half)
            rank = np.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
            row_start = rank * self.local_rows + (start // cp)[:, None] + np.where(chunk < cp, 0, half)
            delta = row_start - (token_start[:, None] + chunk * half)
        segment = self._to_device(np.stack([counts.ravel(), delta.ravel()]))
        seg = torch.repeat_interleave(segment[0], output_size=self.num_tokens)
        self._token_rows = segment[1].index_select(0, seg).add_(_arange(self.num_tokens, self._device))
        return self._token_rows

    def gather(self, local: torch.Tensor, group=None, cp_rank: int | None = None) -> torch.Tensor:
        """All-gather ``local`` ``[local_rows, ...]`` over the CP group, concatenated in rank order.

        The gradient flows through this rank's own shard only (each rank backpropagates its rows).
        """
        if local.shape[0] != self.local_rows:
            raise ValueError(f"expected {self.local_rows} local rows, got shape {tuple(local.shape)}.")
        if self.cp_size == 1:
            return local
        import torch.distributed as dist

        world = dist.get_world_size(group)
        if world != self.cp_size:
            raise ValueError(f"the CP group has {world} ranks but the plan was made for cp_size={self.cp_size}.")
        if cp_rank is None:
            cp_rank = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(self.cp_size)]
        dist.all_gather(parts, local.detach().contiguous(), group=group)
        parts[cp_rank] = local
        return torch.cat(parts, dim=0)

    def unpack(self, local: torch.Tensor, group=None, cp_rank: int | None = None) -> torch.Tensor:
        """Reassemble per-row outputs of every rank into a jagged NestedTensor ``[B, j, ...]``.

        Sequences come back in their original order (also with a custom ``order``); padding rows
        are dropped. ``group`` is the CP process group (``None``: the default group).
        """
        gathered = self.gather(local, group=group, cp_rank=cp_rank)
        values = gathered.index_select(0, self.token_rows())
        return torch.nested.nested_tensor_from_jagged(values, offsets=self.token_offsets)

    @property
    def device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return (
            f"THDPlan(layout={self.layout.value}, tp={self.options.tp_size}, cp={self.cp_size}, "
            f"batch={self.batch_size}, tokens={self.num_tokens}, total_rows={self.total_rows}, "
            f"local_rows={self.local_rows})"
        )

def _host_int64(tensor: torch.Tensor) -> np.ndarray:
    """A host NumPy int64 copy of an integer tensor (the caller's tensor is never shared)."""
    host = tensor.detach().to("cpu", torch.long).numpy()
    return host.copy() if tensor.device.type == "cpu" else host


def build_plan(
    seqlens: torch.Tensor | Sequence[int],
    options: PlanOptions,
    order: torch.Tensor | Sequence[int] | None = None,
    token_offsets: torch.Tensor | None = None,
    cp_group=None,
) -> THDPlan:
    """Plan one micro-batch from its sequence lengths.

    Args:
        seqlens: ``[B]`` integer lengths in original order (a jagged tensor's ``offsets().diff()``).
        options: layout and padding options.
        order: optional permutation; buffer slot ``k`` holds sequence ``order[k]`` (a balanced
            contiguous layout reorders sequences; outputs still come back in original order).
        token_offsets: optional ``[B + 1]`` offsets the lengths came from (a jagged tensor's
            ``offsets()``), kept as the plan's ``token_offsets`` instead of a copy.
        cp_group: optional ``torch.distributed`` CP process group (``cp_size`` ranks). When the
            order comes from ``options.balance`` (no explicit ``order``, ``cp_size > 1``), every
            rank computed it on its own host: the ranks then check that they agree
            (:func:`check_order_agreement`: one all-reduce of a 2-element int64 tensor per plan,
            plus reading it back on the host) and raise a ``RuntimeError`` when they do not.
            ``None``, balance off or an explicit order: nothing is checked, no collective.
    """
    if not isinstance(seqlens, torch.Tensor):
        seqlens = torch.as_tensor(list(seqlens), dtype=torch.long)
    if seqlens.dim() != 1 or seqlens.dtype.is_floating_point or seqlens.dtype == torch.bool:
        raise ValueError(f"seqlens must be a 1-D integer tensor, got dtype {seqlens.dtype} shape {tuple(seqlens.shape)}.")
    batch_size = int(seqlens.shape[0])
    if batch_size == 0:
        raise ValueError("cannot plan an empty micro-batch (no sequences).")
    seqlens = seqlens.long()
    device = seqlens.device
    host_order = None
    if order is not None:
        order = torch.as_tensor(order, dtype=torch.long, device=device)
        if order.shape != seqlens.shape:
            raise ValueError(f"order must be a permutation of {batch_size} sequences, got shape {tuple(order.shape)}.")
        # The plan's single device-to-host transfer: the lengths (and the order).
        host_seqlens, host_order = _host_int64(torch.stack([seqlens, order]))
        if not np.array_equal(np.sort(host_order), np.arange(batch_size)):
            raise ValueError(f"order must be a permutation of range({batch_size}).")
    else:
        host_seqlens = _host_int64(seqlens)  # the plan's single device-to-host transfer
    if host_seqlens.min() < 0:
        raise ValueError(f"sequence lengths must be non-negative, got a minimum of {host_seqlens.min()}.")
    if order is None and options.balance is not None and options.cp_size > 1:
        host_order = balanced_host_order(host_seqlens, options)  # on the host, from the same lengths
        if cp_group is not None:
            check_order_agreement(host_order, cp_group, options.cp_size, device)
        order = host_to_device(host_order.copy(), device)
    return _plan_on_host(options, device, host_seqlens, host_order, seqlens, order, token_offsets)


def order_digest(host_order: np.ndarray) -> int:
    """A non-negative int64 digest of an order: the CRC-32 of its int64 little-endian bytes, the
    length in the bits above. Equal orders give equal digests on every host."""
    return zlib.crc32(np.ascontiguousarray(host_order, dtype="<i8").tobytes()) ^ (host_order.shape[0] << 32)


def check_order_agreement(host_order: np.ndarray, group, cp_size: int, device: torch.device) -> None:
    """Check that every rank of the CP ``group`` holds the same ``host_order``.

    One ``all_reduce(MAX)`` of ``[digest, -digest]`` (int64; on the CPU for gloo, on the CUDA
    device of ``device``, or the current one, for NCCL): every rank sees the largest and the
    smallest digest and all raise together when they differ.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world != cp_size:
        raise ValueError(f"cp_group has {world} ranks but the plan is for cp_size={cp_size}; pass the CP group.")
    digest = order_digest(host_order)
    on = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        on = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=on)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = both.tolist()  # the check's one host read
    low = -neg_low
    if high != low:
        raise RuntimeError(
            f"CP ranks computed different balanced orders for this micro-batch (order digests range "
            f"{low}..{high}; this rank: {digest}, rank {dist.get_rank(group)} of the CP group). The order "
            "is computed on every rank from float64 host arithmetic: run identical NumPy builds on "
            "every rank (same package and CPU kind), or set cp_balance=null (PlanOptions.balance=None)."
        )


def plan_from_offsets(offsets: torch.Tensor, options: PlanOptions, cp_group=None) -> THDPlan:
    """Plan a micro-batch from a jagged tensor's ``offsets()`` ``[B + 1]`` (one transfer, no
    device-side work); the plan keeps ``offsets`` as its ``token_offsets``. ``cp_group``: see
    :func:`build_plan` (used only when the order is balanced)."""
    if options.balance is not None and options.cp_size > 1:
        return build_plan(offsets.diff(), options, token_offsets=offsets, cp_group=cp_group)
    if offsets.dim() != 1 or offsets.shape[0] < 2 or offsets.dtype.is_floating_point:
        raise ValueError(f"offsets must be a 1-D integer tensor [B + 1] with B >= 1, got shape {tuple(offsets.shape)}.")
    host_offsets = _host_int64(offsets)  # the plan's single device-to-host transfer
    host_seqlens = host_offsets[1:] - host_offsets[:-1]
    if host_seqlens.min() < 0:
        raise ValueError(f"offsets must be non-decreasing (sequence lengths >= 0), got {host_offsets[:8].tolist()}...")
    return _plan_on_host(options, offsets.device, host_seqlens, None, None, None, offsets)


def _plan_on_host(options, device, host_seqlens, host_order, seqlens, order, token_offsets) -> THDPlan:
    buffer_seqlens = host_seqlens if host_order is None else host_seqlens[host_order]
    padded = buffer_seqlens + (-buffer_seqlens) % options.sequence_alignment
    aligned_total = int(padded.sum())
    padded[-1] += options.padded_total(aligned_total) - aligned_total  # the last sequence absorbs the rest
    return THDPlan(options, device, host_seqlens, host_order, padded, seqlens, order, token_offsets)


def plan_from_padded_lengths(
    seqlens: torch.Tensor, seqlens_padded: torch.Tensor, layout: CPLayout | str, cp_size: int
) -> THDPlan:
    """Rebuild a plan from lengths and the padded lengths another plan chose (e.g. from
    ``PackedSeqParams.cu_seqlens_q_padded``), checking that they describe a valid layout."""
    layout = CPLayout.parse(layout)
    seqlens = seqlens.long()
    if seqlens.shape != seqlens_padded.shape or seqlens.dim() != 1 or seqlens.shape[0] == 0:
        raise ValueError(
            f"lengths {tuple(seqlens.shape)} and padded lengths {tuple(seqlens_padded.shape)} must be "
            "equal-sized, non-empty 1-D tensors (one per sequence)."
        )
    host_seqlens, host_padded = _host_int64(torch.stack([seqlens, seqlens_padded.to(seqlens.device, torch.long)]))
    if (host_padded < host_seqlens).any():
        raise ValueError("a padded length is shorter than its sequence: the padded lengths belong to another batch.")
    total = int(host_padded.sum())
    unit = layout.sequence_alignment(1, cp_size)
    if total % cp_size or (layout is CPLayout.ZIGZAG and (host_padded % unit != 0).any()):
        raise ValueError(
            f"padded lengths do not split into cp_size={cp_size} ranks with the {layout} layout "
            f"(total {total}; zigzag needs every sequence a multiple of 2*cp)."
        )
    options = PlanOptions(layout=layout, cp_size=cp_size)
    return THDPlan(options, seqlens.device, host_seqlens, None, host_padded, seqlens=seqlens)
