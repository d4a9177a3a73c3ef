"""Context-parallel layouts as data (PyTorch and NumPy: imports neither verl nor megatron).

Who owns what (imports run one way, top to bottom; no cycles):

* :mod:`.types`: :class:`CPLayout`, the typed layout and its per-sequence alignment rule.
* :mod:`.cost`: per-token cost models (:class:`~.cost.TokenCostModel`): cost shapes as data.
* :mod:`.options`: :class:`PlanOptions` (layout, TP/CP sizes, padding, balance) and the padding
  rules that follow from them.
* :mod:`.balance`: the balanced contiguous order (which sequence goes to which buffer slot) for
  ``PlanOptions.balance``, and the per-rank cost of an order.
* :mod:`.straggler`: straggler ratios (max / mean cost per CP rank, per micro-batch, per step, between DP
  ranks) of a plan or of lengths, on the host; the engine reports them per step (``perf/cp_straggler_ratio``).
* :mod:`.tables`: the per-rank row tables of a plan (runs of rows per sequence chunk, source
  token, position, padding mask, label shift), built on the lengths' device.
* :mod:`.plan`: :class:`THDPlan` and :func:`build_plan` / :func:`plan_from_offsets` /
  ``plan_from_padded_lengths``, which turn the sequence lengths of a micro-batch into a plan:
  padding, the rows each CP rank owns, gather / position / label-shift indices, and
  :meth:`THDPlan.pack` / :meth:`THDPlan.unpack` for any per-token tensor.
* :mod:`.plan_cli`: ``verl-ds4 plan``, a per-rank table (and plot) of one micro-batch's plan.

Megatron glue (``PackedSeqParams``, parallel state, verl's drop-in signatures) lives one layer
up in :mod:`verl_ds4.mcore.thd`.
"""

from .plan import PlanOptions, THDPlan, build_plan, plan_from_offsets
from .types import CPLayout

__all__ = ["CPLayout", "PlanOptions", "THDPlan", "build_plan", "plan_from_offsets"]
