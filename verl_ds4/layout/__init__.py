"""Context-parallel layouts as data (PyTorch and NumPy: imports neither verl nor megatron).

Who owns what:

* :mod:`.types`: :class:`CPLayout`, the typed layout and its per-sequence alignment rule.
* :mod:`.plan`: :class:`PlanOptions` and :func:`build_plan` / :func:`plan_from_offsets`, which turn
  the sequence lengths of a micro-batch into a :class:`THDPlan`: padding, the rows each CP rank owns, gather / position /
  label-shift indices, and :meth:`THDPlan.pack` / :meth:`THDPlan.unpack` for any per-token tensor.

Megatron glue (``PackedSeqParams``, parallel state, verl's drop-in signatures) lives one layer
up in :mod:`verl_ds4.mcore.thd`.
"""

from .plan import PlanOptions, THDPlan, build_plan, plan_from_offsets
from .types import CPLayout

__all__ = ["CPLayout", "PlanOptions", "THDPlan", "build_plan", "plan_from_offsets"]
