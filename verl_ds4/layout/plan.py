"""The THD plan: padding and CP row ownership for one micro-batch, computed once.

A plan is built from the sequence lengths of a micro-batch and :class:`PlanOptions`. It fixes

* the padded length of every sequence and the global padded buffer of ``total_rows`` rows
  (``cu_seqlens_padded``, identical on every CP rank),
* which ``local_rows = total_rows // cp`` rows each CP rank owns (see :mod:`.types`),
* for a rank: its gather index (local row -> flat source token, ``-1`` for padding), position
  ids, and the label-shift index (local row -> source token of the *next* position),
* for the whole group: where each source token lives after an all-gather, so per-token outputs
  are put back in the original order with one ``index_select``.

Every mapping is a vectorised tensor expression: there is no Python loop over sequences, and
building a plan costs one device-to-host transfer (the few integers that decide tensor shapes).

Padding rules (sizes in rows):

1. each sequence is padded at its tail to a multiple of ``layout.sequence_alignment(tp, cp)``
   (with FP8 padding: ``lcm(16, that)``);
2. the last sequence absorbs any extra padding of the whole buffer, so that the total is
   a. a multiple of ``128 * alignment`` with FP8 padding,
   b. at least ``cp * min_local_rows`` (DS4 needs ``min_local_rows = csa_window_size`` rows per rank),
   c. a multiple of ``pad_to_length_bucket``;
   every extra amount is rounded to the per-sequence alignment so the last sequence stays
   splittable (verl 0.9.1 aligns the bucket to ``cp`` only, which breaks zigzag; see
   :mod:`verl_ds4.mcore.thd`).

Label shift (``shift=True``): the label of position ``p`` of a sequence of length ``n`` is the
token at position ``(p + 1) % n`` of the *same* sequence. The last token's label wraps to the
sequence's first token (it is masked by the loss mask), never to the next sequence or padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .types import CPLayout

_FP8_SEQUENCE_ALIGNMENT = 16  # FP8 block quantisation: each sequence a multiple of 16 rows
_FP8_TOTAL_FACTOR = 128  # ...and the buffer a multiple of 128 * alignment (TransformerEngine)


@dataclass(frozen=True)
class PlanOptions:
    """Everything besides the sequence lengths that decides a plan.

    Attributes:
        layout: ``"zigzag"`` or ``"contiguous"`` (or a :class:`CPLayout`).
        tp_size: tensor-parallel size (local rows must split evenly for sequence parallelism).
        cp_size: context-parallel size (with dynamic CP: the micro-batch's ``local_cp_size``).
        min_local_rows: pad the buffer so that every rank owns at least this many rows.
        pad_to_length_bucket: pad the buffer to a multiple of this many rows (fewer distinct shapes).
        fp8_padding: apply FP8 block-quantisation alignment.
        balance: contiguous layout only: ``None`` (plain order) or the name of a per-token cost
            model (``"ds4"`` or ``"dense"``, see :mod:`.cost`); ``build_plan`` then orders the
            sequences in the buffer to minimise the largest per-rank cost (:mod:`.balance`).
            Padding and row counts are unchanged; outputs still come back in original order.
    """

    layout: CPLayout | str = CPLayout.ZIGZAG
    tp_size: int = 1
    cp_size: int = 1
    min_local_rows: int | None = None
    pad_to_length_bucket: int | None = None
    fp8_padding: bool = False
    balance: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", CPLayout.parse(self.layout))
        if self.balance is not None:
            from .cost import COST_MODELS

            if self.balance not in COST_MODELS:
                raise ValueError(
                    f"PlanOptions.balance must be None or one of {sorted(COST_MODELS)} (a cost model name), "
                    f"got {self.balance!r}."
                )
            if self.layout is not CPLayout.CONTIGUOUS:
                raise ValueError(
                    f"PlanOptions.balance={self.balance!r} reorders sequences of the contiguous layout only, "
                    f"but layout='{self.layout}'. Use layout='contiguous' or balance=None."
                )
        for name in ("tp_size", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlanOptions.{name} must be a positive integer, got {value!r}.")
        if self.min_local_rows is not None and (not isinstance(self.min_local_rows, int) or self.min_local_rows < 0):
            raise ValueError(
                f"PlanOptions.min_local_rows must be a non-negative integer or None, got {self.min_local_rows!r}."
            )
        if self.pad_to_length_bucket is not None and (
            not isinstance(self.pad_to_length_bucket, int) or self.pad_to_length_bucket <= 0
        ):
            raise ValueError(
                "pad_to_length_bucket must be a positive integer (rows the packed buffer is padded to a "
                f"multiple of) or None, got {self.pad_to_length_bucket!r}."
            )

    @property
    def sequence_alignment(self) -> int:
        """Rows every sequence's padded length is a multiple of."""
        base = self.layout.sequence_alignment(self.tp_size, self.cp_size)
        return math.lcm(_FP8_SEQUENCE_ALIGNMENT, base) if self.fp8_padding else base

    def padded_total(self, aligned_total: int) -> int:
        """Total buffer rows once the tail rules (FP8 total, minimum rows, bucket) are applied."""
        unit = self.sequence_alignment
        total = aligned_total
        fp8_total = self.layout.sequence_alignment(self.tp_size, self.cp_size) * _FP8_TOTAL_FACTOR
        if self.fp8_padding:
            total = _round_up(total, fp8_total)
        if self.min_local_rows is not None:
            total = max(total, _round_up(self.cp_size * self.min_local_rows, unit))
        if self.pad_to_length_bucket is not None:
            multiple = math.lcm(self.pad_to_length_bucket, unit)
            if self.fp8_padding:
                multiple = math.lcm(multiple, fp8_total)
            total = _round_up(total, multiple)
        return total


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class RankRows(NamedTuple):
    """Per local row of one CP rank (``[local_rows]`` integer tensors, int32 while every index
    fits, else int64; ``valid`` and ``keep_position`` are bool).

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


class THDPlan:
    """Padding and CP ownership of one micro-batch. Build it with :func:`build_plan`.

    Tensors (on the device of the lengths; ``B`` sequences, ``T`` real tokens):

    * ``seqlens`` ``[B]`` int64, original order; ``token_offsets`` ``[B + 1]`` int64, where each
      sequence starts in the flat token tensor (``values()`` of a jagged input).
    * ``order`` ``[B]``: buffer slot ``k`` holds sequence ``order[k]`` (identity unless given).
    * ``cu_seqlens`` / ``cu_seqlens_padded`` ``[B + 1]`` int32: real / padded cumulative lengths in
      buffer order, global (identical on every rank).

    Python ints: ``batch_size``, ``num_tokens``, ``total_rows``, ``local_rows``, ``max_seqlen_padded``.
    """

    def __init__(
        self,
        options: PlanOptions,
        seqlens: torch.Tensor,
        order: torch.Tensor | None,
        seqlens_padded: torch.Tensor,
        num_tokens: int,
        total_rows: int,
        max_seqlen_padded: int,
    ) -> None:
        self.options = options
        self.layout = options.layout
        self.cp_size = options.cp_size
        self.seqlens = seqlens
        self.batch_size = int(seqlens.shape[0])
        self.num_tokens = num_tokens
        self.total_rows = total_rows
        self.local_rows = total_rows // options.cp_size
        self.max_seqlen_padded = max_seqlen_padded
        device = seqlens.device

        self.token_offsets = torch.zeros(self.batch_size + 1, dtype=torch.long, device=device)
        torch.cumsum(seqlens, 0, out=self.token_offsets[1:])
        self.order = order
        if order is None:
            self._buffer_seqlens = seqlens
            self._buffer_token_starts = self.token_offsets[:-1]
            self._slot_of_sequence = None
        else:
            self._buffer_seqlens = seqlens.index_select(0, order)
            self._buffer_token_starts = self.token_offsets[:-1].index_select(0, order)
            self._slot_of_sequence = torch.empty_like(order)
            self._slot_of_sequence[order] = torch.arange(self.batch_size, device=device)
        self.seqlens_padded = seqlens_padded  # buffer order
        self._cu_padded = torch.zeros(self.batch_size + 1, dtype=torch.long, device=device)
        torch.cumsum(seqlens_padded, 0, out=self._cu_padded[1:])
        cu_real = torch.zeros_like(self._cu_padded)
        torch.cumsum(self._buffer_seqlens, 0, out=cu_real[1:])
        self.cu_seqlens = cu_real.to(torch.int32)
        self.cu_seqlens_padded = self._cu_padded.to(torch.int32)
        self._rank_cache: dict[int, RankRows] = {}
        self._token_rows: torch.Tensor | None = None

    # ------------------------------------------------------------------ per-rank row maps
    def _check_rank(self, cp_rank: int) -> None:
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {cp_rank}.")

    def rank_rows(self, cp_rank: int) -> RankRows:
        """What each of ``cp_rank``'s local rows holds (cached per rank).

        A rank's rows are a few runs per sequence (one for contiguous, two chunks for zigzag)
        inside which the position grows by one per row. The runs are described per sequence and
        expanded to rows with one ``repeat_interleave``; the rest is elementwise.
        """
        self._check_rank(cp_rank)
        cached = self._rank_cache.get(cp_rank)
        if cached is not None:
            return cached
        device = self.seqlens.device
        starts = self._cu_padded[:-1]
        if self.layout is CPLayout.CONTIGUOUS or self.cp_size == 1:
            w0 = cp_rank * self.local_rows
            w1 = w0 + self.local_rows
            counts = self._cu_padded[1:].clamp(w0, w1) - starts.clamp(w0, w1)
            # row j of the window holds padded position j + (w0 - start) of its sequence
            position_base = w0 - starts
            keep = None
        else:
            cp = self.cp_size
            half = self.seqlens_padded // (2 * cp)
            local_start = starts // cp
            # chunk r at local rows [ls, ls + h), chunk 2cp-1-r at [ls + h, ls + 2h)
            # run 2s + c is chunk c (0: chunk r, 1: chunk 2cp-1-r) of sequence s
            counts = half.repeat_interleave(2)
            position_base = torch.stack(
                [cp_rank * half - local_start, (2 * cp - 2 - cp_rank) * half - local_start], 1
            ).flatten()
            keep = True
        # int32 row tables (half the memory traffic of int64) while every index fits.
        itype = torch.int32 if max(self.total_rows, self.num_tokens) < 2**31 else torch.long
        run = torch.repeat_interleave(
            torch.arange(counts.shape[0], device=device, dtype=itype), counts, output_size=self.local_rows
        )
        local = torch.arange(self.local_rows, device=device, dtype=itype)
        position = local + position_base.to(itype).index_select(0, run)
        if keep is None:
            slot, keep_position = run, None
        else:
            # verl 0.9.1 keeps the running position on padding rows of a rank's first chunk.
            slot, keep_position = run >> 1, (run & 1) == 0
        source = position + self._buffer_token_starts.to(itype).index_select(0, slot)
        seqlen = self._buffer_seqlens.to(itype).index_select(0, slot)
        valid = position < seqlen
        rows = RankRows(slot, position, source, seqlen, valid, keep_position)
        self._rank_cache[cp_rank] = rows
        return rows

    def gather_index(self, cp_rank: int, shift: bool = False) -> torch.Tensor:
        """``[local_rows]`` int64: flat source token of each local row (``-1`` on padding rows).

        With ``shift=True`` the source is the next position of the same sequence (the label).
        """
        rows = self.rank_rows(cp_rank)
        source = rows.source
        if shift:
            source = source + 1 - rows.seqlen * (rows.position + 1 == rows.seqlen)
        return torch.where(rows.valid, source, -1).long()

    def position_ids(self, cp_rank: int, shift: bool = False) -> torch.Tensor:
        """``[local_rows]`` int64: position inside its sequence of each local row's source token.

        Padding rows get 0 (zigzag first-chunk padding rows keep their padded position, as in verl).
        With ``shift=True``: the position of the label token, ``(p + 1) % n``.
        """
        rows = self.rank_rows(cp_rank)
        if shift:
            position = rows.position + 1
            return torch.where(rows.valid & (position != rows.seqlen), position, 0).long()
        keep = rows.valid if rows.keep_position is None else rows.valid | rows.keep_position
        return torch.where(keep, rows.position, 0).long()

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
        rows = self.rank_rows(cp_rank)
        source = rows.source
        if shift:
            source = source + 1 - rows.seqlen * (rows.position + 1 == rows.seqlen)
        # Padding rows read a clamped (in-range) source, then get overwritten with ``fill``.
        out = values.index_select(0, source.clamp(max=self.num_tokens - 1))
        padding = ~rows.valid
        return out.masked_fill(padding.view(-1, *([1] * (values.dim() - 1))), fill)

    def token_rows(self) -> torch.Tensor:
        """``[T]`` int64: row of each source token in the rank-ordered concatenation of all ranks."""
        if self._token_rows is not None:
            return self._token_rows
        device = self.seqlens.device
        sequence = torch.repeat_interleave(
            torch.arange(self.batch_size, device=device), self.seqlens, output_size=self.num_tokens
        )
        position = torch.arange(self.num_tokens, device=device) - self.token_offsets.index_select(0, sequence)
        slot = sequence if self._slot_of_sequence is None else self._slot_of_sequence.index_select(0, sequence)
        start = self._cu_padded.index_select(0, slot)
        if self.layout is CPLayout.CONTIGUOUS or self.cp_size == 1:
            rows = start + position
        else:
            cp = self.cp_size
            half = self.seqlens_padded.index_select(0, slot) // (2 * cp)
            chunk = torch.div(position, half, rounding_mode="floor")
            first = chunk < cp
            rank = torch.where(first, chunk, 2 * cp - 1 - chunk)
            within = position - chunk * half + torch.where(first, 0, half)
            rows = rank * self.local_rows + start // cp + within
        self._token_rows = rows
        return rows

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

    def __repr__(self) -> str:
        return (
            f"THDPlan(layout={self.layout.value}, tp={self.options.tp_size}, cp={self.cp_size}, "
            f"batch={self.batch_size}, tokens={self.num_tokens}, total_rows={self.total_rows}, "
            f"local_rows={self.local_rows})"
        )


def build_plan(
    seqlens: torch.Tensor | Sequence[int],
    options: PlanOptions,
    order: torch.Tensor | Sequence[int] | None = None,
) -> THDPlan:
    """Plan one micro-batch from its sequence lengths.

    Args:
        seqlens: ``[B]`` integer lengths in original order (a jagged tensor's ``offsets().diff()``).
        options: layout and padding options.
        order: optional permutation; buffer slot ``k`` holds sequence ``order[k]`` (a balanced
            contiguous layout reorders sequences; outputs still come back in original order).
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
    if order is None and options.balance is not None and options.cp_size > 1:
        from .balance import balanced_order_for_plan

        order = balanced_order_for_plan(seqlens, options)
    if order is not None:
        order = torch.as_tensor(order, dtype=torch.long, device=device)
        if order.shape != seqlens.shape:
            raise ValueError(f"order must be a permutation of {batch_size} sequences, got shape {tuple(order.shape)}.")
        buffer_seqlens = seqlens.index_select(0, order.clamp(0, batch_size - 1))
    else:
        buffer_seqlens = seqlens

    unit = options.sequence_alignment
    seqlens_padded = buffer_seqlens + (-buffer_seqlens) % unit
    facts = [seqlens.sum(), seqlens_padded.sum(), seqlens_padded.max(), seqlens_padded[-1], seqlens.min()]
    if order is not None:
        facts.append((torch.sort(order).values == torch.arange(batch_size, device=device)).all().long())
    # The plan's single device-to-host transfer: the integers that decide tensor shapes.
    num_tokens, aligned_total, max_padded, last_padded, min_len, *perm_ok = torch.stack(facts).tolist()
    if min_len < 0:
        raise ValueError(f"sequence lengths must be non-negative, got a minimum of {min_len}.")
    if perm_ok and not perm_ok[0]:
        raise ValueError(f"order must be a permutation of range({batch_size}).")

    total = options.padded_total(aligned_total)
    extra = total - aligned_total
    if extra:
        seqlens_padded = seqlens_padded.clone()
        seqlens_padded[-1] += extra
        max_padded = max(max_padded, last_padded + extra)
    return THDPlan(options, seqlens, order, seqlens_padded, num_tokens, total, max_padded)


def plan_from_padded_lengths(
    seqlens: torch.Tensor, seqlens_padded: torch.Tensor, layout: CPLayout | str, cp_size: int
) -> THDPlan:
    """Rebuild a plan from lengths and the padded lengths another plan chose (e.g. from
    ``PackedSeqParams.cu_seqlens_q_padded``), checking that they describe a valid layout."""
    layout = CPLayout.parse(layout)
    seqlens = seqlens.long()
    seqlens_padded = seqlens_padded.long().to(seqlens.device)
    if seqlens.shape != seqlens_padded.shape or seqlens.dim() != 1 or seqlens.shape[0] == 0:
        raise ValueError(
            f"lengths {tuple(seqlens.shape)} and padded lengths {tuple(seqlens_padded.shape)} must be "
            "equal-sized, non-empty 1-D tensors (one per sequence)."
        )
    unit = layout.sequence_alignment(1, cp_size)
    facts = torch.stack(
        [
            seqlens.sum(),
            seqlens_padded.sum(),
            seqlens_padded.max(),
            (seqlens_padded < seqlens).any().long(),
            (seqlens_padded % unit != 0).any().long() if layout is CPLayout.ZIGZAG else seqlens.new_zeros(()),
        ]
    ).tolist()
    num_tokens, total, max_padded, too_short, misaligned = facts
    if too_short:
        raise ValueError("a padded length is shorter than its sequence: the padded lengths belong to another batch.")
    if total % cp_size or misaligned:
        raise ValueError(
            f"padded lengths do not split into cp_size={cp_size} ranks with the {layout} layout "
            f"(total {total}; zigzag needs every sequence a multiple of 2*cp)."
        )
    options = PlanOptions(layout=layout, cp_size=cp_size)
    return THDPlan(options, seqlens, None, seqlens_padded, num_tokens, total, max_padded)
