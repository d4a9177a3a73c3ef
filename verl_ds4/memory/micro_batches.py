"""How many micro-batches one pass makes, how many rows each holds, and how many a pipeline stage keeps in flight.

The peak model (:mod:`verl_ds4.memory.stages`, :mod:`verl_ds4.memory.peak`) counts the activations of every
micro-batch a stage holds for backward; this module says how many that is, the way verl and Megatron make them:

* **dynamic batch size** (``use_dynamic_bsz=true``): verl packs a DP rank's sequences into micro-batches of at
  most ``budget x CP`` tokens and keeps adding micro-batches until every one fits, a sequence never split. With
  sequences of the recipe's longest length ``S`` a micro-batch holds ``floor(budget x CP / S)`` of them (one
  each when ``S`` is above half of ``budget x CP``): :func:`packed_micro_batches` packs first-fit. A micro-batch
  holds up to the budget's rows per GPU.
* **fixed micro-batch size** (``use_dynamic_bsz=false``): ``micro_batch_size_per_gpu`` sequences per
  micro-batch, ``ceil(sequences per rank / micro_batch_size_per_gpu)`` of them; a GPU holds up to
  ``micro_batch_size_per_gpu x S / CP`` rows (:func:`static_rows`).
* **virtual pipeline stages** (``vpp``): verl rounds the count up to a multiple of Megatron's
  ``microbatch_group_size_per_vp_stage`` (``G``, default PP); Megatron's interleaved 1F1B warms up with
  ``(PP - rank - 1) x 2 + (vpp - 1) x G`` micro-batch chunks on rank ``rank``, each a ``1 / vpp`` share of the
  stage's layers, plus the one in its steady state (:func:`in_flight`).
"""

from __future__ import annotations

__all__ = ["in_flight", "micro_batches", "packed_micro_batches", "static_rows"]


def packed_micro_batches(lengths: list[int], capacity: int) -> int:
    """Micro-batches of at most ``capacity`` tokens that hold ``lengths`` whole (first-fit, longest first).

    Raises:
        ValueError: a sequence longer than ``capacity`` (verl refuses it; the validator before this does too).
    """
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds a micro-batch of {capacity} tokens; expected "  # error-catalogue: internal: the validator refuses budget x CP below the longest sequence first
                         "budget x CP >= the longest sequence.")
    bins: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, used in enumerate(bins):
            if used + n <= capacity:
                bins[i] += n
                break
        else:
            bins.append(n)
    return len(bins)


def micro_batches(sequences: int, dp: int, max_seq_len: int, *, tokens_per_gpu: int | None = None, cp: int = 1,
                  micro_batch_size: int | None = None, group: int = 1) -> int:
    """Micro-batches of one pass on a DP rank: ``sequences`` over ``dp`` ranks, each ``max_seq_len`` long, packed
    into ``tokens_per_gpu x cp`` (dynamic) or ``micro_batch_size`` at a time (fixed), rounded up to ``group``."""
    per_rank = max(1, -(-sequences // max(dp, 1)))
    if micro_batch_size:
        count = -(-per_rank // micro_batch_size)
    else:
        capacity = max(tokens_per_gpu or 0, 1) * cp
        count = packed_micro_batches([min(max_seq_len, capacity)] * per_rank, capacity)
    return -(-count // max(group, 1)) * max(group, 1)


def static_rows(micro_batch_size: int, max_seq_len: int, cp: int = 1) -> int:
    """Rows per GPU of a fixed-size micro-batch: ``micro_batch_size`` sequences of ``max_seq_len`` over CP ranks."""
    return -(-micro_batch_size * max_seq_len // max(cp, 1))


def in_flight(pp: int, stage: int, micro_batches: int | None = None, vpp: int | None = None, group: int | None = None) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once, in units of the whole stage's layers.

    Non-interleaved 1F1B: ``PP - stage``, at most the pass's micro-batches. Interleaved (``vpp > 1``): the warm-up's
    ``(PP - stage - 1) x 2 + (vpp - 1) x group`` chunks (``group``: ``microbatch_group_size_per_vp_stage``, default
    PP) plus one, at most ``micro_batches x vpp``, each ``1 / vpp``."""
    if not vpp or vpp <= 1:
        depth = pp - stage
        return float(depth if micro_batches is None else max(1, min(depth, micro_batches)))
    chunks = (pp - stage - 1) * 2 + (vpp - 1) * (group or pp) + 1
    if micro_batches is not None:
        chunks = min(chunks, micro_batches * vpp)
    return max(chunks, 1) / vpp
