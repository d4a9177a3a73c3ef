"""Straggler ratios from sequence lengths alone: per CP rank, per micro-batch, per step, and between DP ranks.

A CP group finishes a micro-batch when its most loaded rank does; data-parallel ranks meet at the
gradient reduction once per step. So, with a per-token cost model (:mod:`.cost`: the one the balancer
uses) and ``c[m, r]`` the cost CP rank ``r`` has in micro-batch ``m``:

* micro-batch straggler ratio: ``max_r c[m, r] / mean_r c[m, r]`` (1.0: every CP rank finishes together);
* step CP straggler ratio (one DP rank): ``sum_m max_r c[m, r] / sum_m mean_r c[m, r]``, i.e. the time
  the CP group takes for the step over the time it would take perfectly balanced (micro-batches run one
  after another, so their maxima add up);
* DP straggler ratio: ``max_d C[d] / mean_d C[d]`` with ``C[d]`` the total cost of DP rank ``d``'s
  sequences (each sequence's full cost, independent of CP and micro-batching).

Everything is host arithmetic on int64 lengths (NumPy, closed-form prefix costs): a plan's host copies of
its lengths (:class:`~.plan.THDPlan` fetched them with its one transfer) or a host list; nothing touches
a device. Costs per rank of each layout:

* ``contiguous``: rank ``r`` holds rows ``[r L, (r + 1) L)`` of the padded buffer in buffer order
  (:class:`.balance.BalanceProblem`);
* ``zigzag``: every padded sequence is cut into ``2 cp`` equal chunks, rank ``r`` holds chunks ``r`` and
  ``2 cp - 1 - r`` (:func:`zigzag_rank_costs`).

Padding rows cost ``cost_model.pad_row_cost`` each in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .balance import BalanceProblem
from .cost import TokenCostModel, get_cost_model
from .options import PlanOptions
from .types import CPLayout

__all__ = [
    "StepStraggler",
    "batch_order_rank_costs",
    "contiguous_rank_costs",
    "dp_rank_costs",
    "plan_rank_costs",
    "ratio",
    "zigzag_rank_costs",
]


def ratio(costs) -> float:
    """``max / mean`` of per-rank costs (1.0 for an empty or all-zero vector)."""
    costs = np.asarray(costs, dtype=np.float64)
    mean = float(costs.mean()) if costs.size else 0.0
    return float(costs.max()) / mean if mean > 0 else 1.0


def _lengths(values, name: str) -> np.ndarray:
    host = np.asarray(values)
    if host.ndim != 1 or host.dtype.kind not in "iu" or (host.size and host.min() < 0):
        raise ValueError(f"{name} must be a 1-D array of non-negative integers, got {host.dtype} {host.shape}")
    return host.astype(np.int64)


def contiguous_rank_costs(seqlens, padded, total_rows: int, cp_size: int,
                          cost_model: str | TokenCostModel = "ds4") -> np.ndarray:
    """float64 ``[cp]``: the contiguous buffer holding ``seqlens`` / ``padded`` (buffer order) then
    ``total_rows - sum(padded)`` tail padding rows, cut into ``cp`` equal intervals."""
    real, rows = _lengths(seqlens, "seqlens"), _lengths(padded, "padded")
    prob = BalanceProblem(real, rows, int(total_rows), int(cp_size), get_cost_model(cost_model))
    return prob.costs_np(np.arange(prob.num_seqs, dtype=np.int64)[None, :])[0]


def zigzag_rank_costs(seqlens, padded, cp_size: int, cost_model: str | TokenCostModel = "ds4") -> np.ndarray:
    """float64 ``[cp]``: every sequence (``padded`` rows, ``seqlens`` of them real) cut into ``2 cp`` equal
    chunks; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. ``padded`` must be multiples of ``2 cp``."""
    real, rows = _lengths(seqlens, "seqlens"), _lengths(padded, "padded")
    model = get_cost_model(cost_model)
    cp = int(cp_size)
    if cp == 1:
        return np.array([float(model.prefix_cost(real).sum() + model.pad_row_cost * (rows - real).sum())])
    if real.shape != rows.shape or bool((rows % (2 * cp)).any()) or bool((rows < real).any()):
        raise ValueError(f"zigzag needs padded lengths that are multiples of 2*cp={2 * cp} and >= the lengths")
    chunk = rows // (2 * cp)
    edges = chunk[:, None] * np.arange(2 * cp + 1, dtype=np.int64)[None, :]  # [B, 2cp + 1] row edges
    real_edges = np.minimum(edges, real[:, None])
    per_chunk = np.diff(model.prefix_cost(real_edges), axis=1)  # real rows' cost per chunk
    per_chunk += model.pad_row_cost * np.diff(edges - real_edges, axis=1)  # padding rows
    totals = per_chunk.sum(axis=0)  # [2cp]
    return totals[:cp] + totals[::-1][:cp]


def plan_rank_costs(plan, cost_model: str | TokenCostModel = "ds4") -> np.ndarray:
    """float64 ``[cp]``: the per-rank cost of a :class:`~.plan.THDPlan`'s own buffer (its order, its
    padding), from the plan's host copies of the lengths."""
    seqlens, padded = plan._h_seqlens, plan._h_padded  # buffer order, host (the plan's one transfer)
    if plan.layout is CPLayout.ZIGZAG:
        return zigzag_rank_costs(seqlens, padded, plan.cp_size, cost_model)
    return contiguous_rank_costs(seqlens, padded, plan.total_rows, plan.cp_size, cost_model)


def batch_order_rank_costs(plan, cost_model: str | TokenCostModel = "ds4") -> np.ndarray:
    """float64 ``[cp]``: the plan's micro-batch laid out without ``options.balance`` (sequences in batch
    order), as ``build_plan`` would; equal to :func:`plan_rank_costs` for zigzag or an unbalanced plan."""
    options: PlanOptions = plan.options
    if plan.layout is CPLayout.ZIGZAG or options.balance is None or plan.cp_size == 1:
        return plan_rank_costs(plan, cost_model)
    prob = BalanceProblem.from_options(np.asarray(plan.host_seqlens), options, get_cost_model(cost_model))
    return prob.costs_np(np.arange(prob.num_seqs, dtype=np.int64)[None, :])[0]


def dp_rank_costs(global_seqlens, dp_size: int, cost_model: str | TokenCostModel = "ds4") -> np.ndarray:
    """float64 ``[dp]``: the total cost of each DP rank's sequences, ``global_seqlens`` being every DP
    rank's lengths concatenated in rank order, the same number per rank (verl's ``global_token_num``)."""
    lengths = _lengths(global_seqlens, "global_seqlens")
    if dp_size < 1 or lengths.size % dp_size:
        raise ValueError(f"{lengths.size} sequences do not split into dp_size={dp_size} equal shares")
    return get_cost_model(cost_model).prefix_cost(lengths).reshape(dp_size, -1).sum(axis=1)


@dataclass
class StepStraggler:
    """Per-micro-batch CP costs of one step (one ``forward_backward_batch``) and the ratios they give.

    :meth:`add` takes a micro-batch's plan; :meth:`metrics` returns verl-style metric values (each a
    one-element list, as the engine's per-step metrics are gathered over DP ranks and flattened).
    """

    cost_model: TokenCostModel
    max_costs: list = field(default_factory=list)
    mean_costs: list = field(default_factory=list)
    batch_order_max_costs: list = field(default_factory=list)
    batch_order_mean_costs: list = field(default_factory=list)

    def add_costs(self, costs, batch_order_costs=None) -> None:
        costs = np.asarray(costs, dtype=np.float64)
        plain = costs if batch_order_costs is None else np.asarray(batch_order_costs, dtype=np.float64)
        self.max_costs.append(float(costs.max()))
        self.mean_costs.append(float(costs.mean()))
        self.batch_order_max_costs.append(float(plain.max()))
        self.batch_order_mean_costs.append(float(plain.mean()))

    def add(self, plan) -> None:
        self.add_costs(plan_rank_costs(plan, self.cost_model), batch_order_rank_costs(plan, self.cost_model))

    @property
    def num_micro_batches(self) -> int:
        return len(self.max_costs)

    def cp_ratio(self, batch_order: bool = False) -> float:
        mx, mean = (self.batch_order_max_costs, self.batch_order_mean_costs) if batch_order else (
            self.max_costs, self.mean_costs)
        total = sum(mean)
        return sum(mx) / total if total > 0 else 1.0

    def worst_micro_batch(self) -> float:
        return max((m / a if a > 0 else 1.0 for m, a in zip(self.max_costs, self.mean_costs)), default=1.0)

    def metrics(self, prefix: str = "perf/") -> dict[str, list[float]]:
        """``{prefix}cp_straggler_ratio`` (the step), ``..._max`` (worst micro-batch) and ``..._batch_order``
        (the step with every micro-batch in batch order); empty without micro-batches."""
        if not self.max_costs:
            return {}
        return {
            f"{prefix}cp_straggler_ratio": [self.cp_ratio()],
            f"{prefix}cp_straggler_ratio_max": [self.worst_micro_batch()],
            f"{prefix}cp_straggler_ratio_batch_order": [self.cp_ratio(batch_order=True)],
        }
