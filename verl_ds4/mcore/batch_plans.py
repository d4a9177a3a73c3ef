"""One plan per micro-batch, shared by every data path that touches it.

Inside one micro-batch the engine packs several jagged tensors of the same lengths: router-replay
routes (verl packs them before the model call), the model's input ids, labels, masks, MTP inputs,
and it unpacks the outputs. :func:`micro_batch_plans` opens a scope (the engine opens one per
``forward_step``; the dynamic-CP scheduler seeds it with the plan it built while scheduling) in
which :func:`plan_for` returns the *same* :class:`~verl_ds4.layout.THDPlan` for every tensor of the
micro-batch, so the plan's single device-to-host transfer of the lengths happens once.

A cached plan is reused for a tensor when the options are equal and the tensor's offsets are the
plan's own offsets object, or have the same number of sequences and tokens (host ints) *and*
equal values; the value check runs on the device (``torch._assert_async``: no synchronisation on
a GPU, an immediate error on the CPU), so a micro-batch of other lengths can never be packed with
a stale plan.

Host-side lengths (MTP builds nested labels from them): :func:`host_seqlens` reads them from the
plan (``THDPlan.host_seqlens``), which fetched them with its one transfer.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from verl_ds4.layout import PlanOptions, THDPlan, plan_from_offsets

__all__ = ["PLAN_KEY", "host_seqlens", "micro_batch_plans", "num_tokens", "plan_for", "scope_plans", "seed_plan"]

#: The non-tensor key of a scheduled (dynamic-CP) micro-batch that carries its plan.
PLAN_KEY = "_verl_ds4_thd_plan"

_SCOPE: contextvars.ContextVar[list | None] = contextvars.ContextVar("verl_ds4_micro_batch_plans", default=None)


@contextlib.contextmanager
def micro_batch_plans(seed: THDPlan | None = None):
    """A scope in which every tensor of one micro-batch is packed with one plan."""
    token = _SCOPE.set([] if seed is None else [seed])
    try:
        yield
    finally:
        _SCOPE.reset(token)


def seed_plan(plan: THDPlan | None) -> None:
    """Add a plan built elsewhere (the dynamic-CP scheduler's) to the open scope, if any."""
    plans = _SCOPE.get()
    if plans is not None and plan is not None and all(p is not plan for p in plans):
        plans.append(plan)


def scope_plans() -> tuple[THDPlan, ...]:
    """The plans of the open scope, first built (or seeded) first; empty outside a scope."""
    return tuple(_SCOPE.get() or ())


def num_tokens(nested: torch.Tensor) -> int:
    values = getattr(nested, "_values", None)
    return int((values if values is not None else nested.values()).shape[0])


def _matches(plan: THDPlan, offsets: torch.Tensor, num_tokens: int, options: PlanOptions) -> bool:
    if plan.options != options:
        return False
    own = plan.token_offsets
    if offsets is own:
        return True
    if (int(offsets.shape[0]), num_tokens) != (plan.batch_size + 1, plan.num_tokens):
        return False
    torch._assert_async(
        torch.eq(offsets.to(own.device), own).all(),
        "verl-ds4: a tensor of this micro-batch has other sequence lengths than the micro-batch's plan",
    )
    return True


def plan_for(input_ids: torch.Tensor, options: PlanOptions, cp_group=None) -> THDPlan:
    """The micro-batch's plan for a jagged tensor: the scope's, else a new one (added to the scope)."""
    offsets = input_ids.offsets()
    plans = _SCOPE.get()
    if plans is not None:
        tokens = num_tokens(input_ids)
        for plan in plans:
            if _matches(plan, offsets, tokens, options):
                return plan
    plan = plan_from_offsets(offsets, options, cp_group=cp_group)
    if plans is not None:
        plans.append(plan)
    return plan


def host_seqlens(plan: THDPlan) -> list[int]:
    """The plan's sequence lengths (original order) as host ints, from its one transfer."""
    return plan.host_seqlens.tolist()
