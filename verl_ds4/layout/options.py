"""Plan options: everything besides the sequence lengths that decides a THD plan, and the
padding rules that follow from them (no tensors, no plan).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import COST_MODELS, TokenCostModel
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
        balance: contiguous layout only: ``None`` (plain order), the name of a per-token cost
            model (``"ds4"`` or ``"dense"``, see :mod:`.cost`) or a :class:`.cost.TokenCostModel`
            (e.g. ``ds4_cost_model(DS4CostShape(...))`` for the model's actual shape);
            ``build_plan`` then orders the sequences in the buffer to minimise the largest
            per-rank cost (:mod:`.balance`).
            Padding and row counts are unchanged; outputs still come back in original order.
    """

    layout: CPLayout | str = CPLayout.ZIGZAG
    tp_size: int = 1
    cp_size: int = 1
    min_local_rows: int | None = None
    pad_to_length_bucket: int | None = None
    fp8_padding: bool = False
    balance: str | TokenCostModel | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", CPLayout.parse(self.layout))
        if self.balance is not None:
            if not isinstance(self.balance, TokenCostModel) and (
                not isinstance(self.balance, str) or self.balance not in COST_MODELS
            ):
                raise ValueError(
                    f"PlanOptions.balance must be None, one of {sorted(COST_MODELS)} (a cost model name) or a "
                    f"TokenCostModel instance (verl_ds4.layout.cost), got {self.balance!r}."
                )
            if self.layout is not CPLayout.CONTIGUOUS:
                raise ValueError(
                    f"PlanOptions.balance={self.balance_name!r} reorders sequences of the contiguous layout only, "
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
    def balance_name(self) -> str | None:
        """The cost model's name when balancing (``None``: off); for messages and logs."""
        return self.balance.name if isinstance(self.balance, TokenCostModel) else self.balance

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

