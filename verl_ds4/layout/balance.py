"""Balanced contiguous CP layout: choose the order of sequences in the packed buffer.

DS4 accepts only equal contiguous slices of one packed buffer (rank ``r`` holds rows
``[r*L, (r+1)*L)``), with padding at sequence tails. Zigzag balancing is impossible there,
but the *order* of sequences in the buffer is free: it decides which sequences land on which
rank and where sequences straddle rank boundaries. This module picks that order to minimise
the largest per-rank cost under a :mod:`~verl_ds4.layout.cost` model.

Contract:
  * ``order`` is a permutation of ``range(B)``: buffer position ``k`` holds sequence ``order[k]``
    (the ``order=`` argument of the layout plan). Padded lengths and the total row count do not
    depend on the order, so the balanced layout keeps every DS4 invariant and unpacking restores
    the original order exactly (the plan's job).
  * Deterministic: the result is a pure function of the lengths and options (no clocks, no
    unseeded randomness), because every CP rank computes the plan on its own and all must agree.
  * Never worse than the plain order under the chosen cost model: the identity order is always
    a candidate and a move is only accepted when it lowers the objective.

Cost of a rank: each of its rows costs ``c(position inside its sequence)``; padding rows cost
``pad_row_cost``. A sequence straddling a boundary therefore splits its cost by position (its
cheap head on the left rank, its expensive tail on the right one). Costs are evaluated with
closed-form prefix sums at the ``cp - 1`` boundaries only, batched over candidate orders.

Algorithm (all vectorised; Python loops run over rounds, never over sequences):
  1. candidates: plain order; an "excess merge" that interleaves sequences whose cost per row is
     above the buffer mean with those below it so the cumulative cost tracks the straight line
     from 0 to the total (boundaries then cut near ``r * mean``); longest-first; and a snake
     partition by cost. The best is kept.
  2. local search: best-improvement over swap and move(remove+insert) neighbourhoods centred on
     the most and least loaded ranks, objective (max rank cost, then sum of squares).
  3. tiny batches (``B <= exhaustive_max``): all ``B!`` orders are evaluated, so the answer is optimal.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .cost import TokenCostModel, get_cost_model

__all__ = [
    "BalanceProblem",
    "balance_order",
    "contiguous_padded_lengths",
    "rank_costs",
    "straggler_ratio",
    "straggler_lower_bound",
]

_REL_TOL = 1e-12


def contiguous_padded_lengths(
    seqlens: torch.Tensor,
    *,
    cp_size: int,
    tp_size: int = 1,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Per-sequence padded lengths and the total row count of a contiguous buffer.

    Each sequence is padded to a multiple of ``tp*cp``; the total is then raised to at least
    ``cp*min_local_rows`` and rounded up to a multiple of ``lcm(bucket, tp*cp)``. The extra total
    padding sits at the buffer tail, so it does not depend on the order.
    """
    align = tp_size * cp_size
    padded = (seqlens + align - 1) // align * align
    total = int(padded.sum())
    if min_local_rows is not None:
        total = max(total, cp_size * int(min_local_rows))
        total = (total + align - 1) // align * align
    if pad_to_length_bucket:
        mult = math.lcm(int(pad_to_length_bucket), align)
        total = (total + mult - 1) // mult * mult
    return padded, total


def _as_lengths(seqlens) -> torch.Tensor:
    t = torch.as_tensor(seqlens)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"seqlens must be a non-empty 1-D tensor of sequence lengths, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"seqlens must be integers, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if bool((t <= 0).any()):
        raise ValueError(f"every sequence length must be >= 1, got min {int(t.min())}")
    return t


@dataclass
class BalanceProblem:
    """Everything order-independent about one micro-batch: lengths, padding, per-sequence cost.

    ``padded`` are the per-sequence padded lengths in *original* order and ``total_rows`` the
    buffer length (``>= padded.sum()``; the difference is tail padding after the last sequence).
    """

    seqlens: torch.Tensor  # int64 [B]
    padded: torch.Tensor  # int64 [B]
    total_rows: int
    cp_size: int
    cost_model: TokenCostModel

    def __post_init__(self):
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if self.padded.shape != self.seqlens.shape or bool((self.padded < self.seqlens).any()):
            raise ValueError("padded lengths must have the same shape as seqlens and be >= them")
        if self.total_rows % self.cp_size or self.total_rows < int(self.padded.sum()):
            raise ValueError(
                f"total_rows={self.total_rows} must be a multiple of cp_size={self.cp_size} and >= the sum of "
                f"padded lengths ({int(self.padded.sum())})"
            )
        self.local_rows = self.total_rows // self.cp_size
        self.seq_cost = self.cost_model.sequence_cost(self.seqlens, self.padded)
        self.tail_rows = self.total_rows - int(self.padded.sum())
        self.total_cost = float(self.seq_cost.sum()) + self.cost_model.pad_row_cost * self.tail_rows
        self._bounds = torch.arange(1, self.cp_size, dtype=torch.int64) * self.local_rows

    @classmethod
    def contiguous(
        cls,
        seqlens,
        *,
        cp_size: int,
        cost_model: str | TokenCostModel = "ds4",
        tp_size: int = 1,
        min_local_rows: int | None = None,
        pad_to_length_bucket: int | None = None,
    ) -> "BalanceProblem":
        lens = _as_lengths(seqlens)
        padded, total = contiguous_padded_lengths(
            lens,
            cp_size=cp_size,
            tp_size=tp_size,
            min_local_rows=min_local_rows,
            pad_to_length_bucket=pad_to_length_bucket,
        )
        return cls(lens, padded, total, cp_size, get_cost_model(cost_model))

    @property
    def num_seqs(self) -> int:
        return int(self.seqlens.numel())

    def costs(self, orders: torch.Tensor) -> torch.Tensor:
        """Per-rank costs ``[K, cp]`` (float64) for a batch of orders ``[K, B]`` (or ``[cp]`` for ``[B]``)."""
        single = orders.dim() == 1
        orders = orders.view(1, -1) if single else orders
        k, b = orders.shape
        cp = self.cp_size
        if cp == 1:
            out = torch.full((k, 1), self.total_cost, dtype=torch.float64)
            return out[0] if single else out
        p = self.padded[orders]
        zero_i = torch.zeros((k, 1), dtype=torch.int64)
        cum_rows = torch.cat([zero_i, p.cumsum(1)], 1)  # [K, B+1], row where buffer seq k starts
        cum_cost = torch.cat([torch.zeros((k, 1), dtype=torch.float64), self.seq_cost[orders].cumsum(1)], 1)
        x = self._bounds.expand(k, cp - 1).contiguous()
        idx = torch.searchsorted(cum_rows, x, right=True) - 1  # buffer slot containing row x (B = tail)
        slot = idx.clamp(max=b - 1)
        seq = orders.gather(1, slot)
        off = x - cum_rows.gather(1, idx)
        n = self.seqlens[seq]
        real = torch.minimum(off, n)
        inside = (
            cum_cost.gather(1, idx)
            + self.cost_model.prefix_cost(real)
            + self.cost_model.pad_row_cost * (off - real).to(torch.float64)
        )
        in_tail = cum_cost[:, -1:] + self.cost_model.pad_row_cost * off.to(torch.float64)
        g = torch.where(idx >= b, in_tail, inside)
        g = torch.cat(
            [torch.zeros((k, 1), dtype=torch.float64), g, torch.full((k, 1), self.total_cost, dtype=torch.float64)], 1
        )
        out = g.diff(dim=1)
        return out[0] if single else out

    def boundary_slots(self, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For one order: buffer slots of the first and last sequence touching each rank ``[cp]`` each."""
        cum_rows = torch.cat([torch.zeros(1, dtype=torch.int64), self.padded[order].cumsum(0)])
        starts = torch.arange(self.cp_size, dtype=torch.int64) * self.local_rows
        first = torch.searchsorted(cum_rows, starts, right=True) - 1
        last = torch.searchsorted(cum_rows, starts + self.local_rows - 1, right=True) - 1
        b = self.num_seqs
        return first.clamp(max=b - 1), last.clamp(max=b - 1)


def _objective(costs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return costs.max(-1).values, (costs * costs).sum(-1)


def _pick_best(costs: torch.Tensor) -> int:
    """Index of the lexicographically best (max, sum of squares) row of ``costs [K, cp]``."""
    mx, sq = _objective(costs)
    best = mx.min()
    near = mx <= best * (1 + _REL_TOL)
    sq = torch.where(near, sq, torch.full_like(sq, float("inf")))
    return int(sq.argmin())


def _better(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Is cost vector ``a`` strictly better than ``b`` (lexicographic max, then sum of squares)?"""
    ma, sa = float(a.max()), float((a * a).sum())
    mb, sb = float(b.max()), float((b * b).sum())
    if ma < mb * (1 - _REL_TOL):
        return True
    return ma <= mb * (1 + _REL_TOL) and sa < sb * (1 - _REL_TOL)


# ----------------------------------------------------------------------------------------------
# constructive candidates


def _excess_merge_order(prob: BalanceProblem) -> torch.Tensor:
    """Interleave above-mean and below-mean sequences so cumulative cost tracks the mean line."""
    mean_row = prob.total_cost / prob.total_rows
    excess = prob.seq_cost - mean_row * prob.padded.to(torch.float64)
    pos = excess >= 0
    key = torch.empty_like(excess)
    for mask in (pos, ~pos):
        ids = mask.nonzero().flatten()
        if ids.numel() == 0:
            continue
        mag = excess[ids].abs()
        srt = torch.argsort(mag, descending=True, stable=True)
        ids, mag = ids[srt], mag[srt]
        total = float(mag.sum())
        if total <= 0:
            key[ids] = (torch.arange(ids.numel(), dtype=torch.float64) + 0.5) / ids.numel()
        else:
            key[ids] = (mag.cumsum(0) - mag / 2) / total
    return torch.argsort(key, stable=True)


def _snake_order(prob: BalanceProblem) -> torch.Tensor:
    """Snake-assign sequences sorted by cost to ``cp`` groups and concatenate the groups."""
    cp, b = prob.cp_size, prob.num_seqs
    srt = torch.argsort(prob.seq_cost, descending=True, stable=True)
    i = torch.arange(b)
    rnd, pos = i // cp, i % cp
    group = torch.where(rnd % 2 == 0, pos, cp - 1 - pos)
    key = group * b + i
    return srt[torch.argsort(key)]


def _candidates(prob: BalanceProblem) -> torch.Tensor:
    b = prob.num_seqs
    ident = torch.arange(b)
    longest = torch.argsort(prob.padded, descending=True, stable=True)
    cands = [ident, _excess_merge_order(prob), longest, _snake_order(prob), longest.flip(0)]
    return torch.stack(cands)


# ----------------------------------------------------------------------------------------------
# local search


def _swap_orders(order: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    k = i.numel()
    out = order.expand(k, -1).clone()
    rows = torch.arange(k)
    out[rows, i] = order[j]
    out[rows, j] = order[i]
    return out


def _move_orders(order: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Orders with the element at slot ``i`` removed and reinserted at slot ``j`` (batched)."""
    b = order.numel()
    t = torch.arange(b).view(1, -1)
    i, j = i.view(-1, 1), j.view(-1, 1)
    src = t.clone().expand(i.shape[0], -1).clone()
    fwd = (i < j) & (t >= i) & (t < j)  # shift left
    bwd = (i > j) & (t > j) & (t <= i)  # shift right
    src = torch.where(fwd, t + 1, src)
    src = torch.where(bwd, t - 1, src)
    src = torch.where(t == j, i.expand_as(src), src)
    return order[src]


def _spread(lo: int, hi: int, count: int) -> torch.Tensor:
    """Up to ``count`` evenly spread integers in ``[lo, hi]`` (all of them when few)."""
    n = hi - lo + 1
    if n <= count:
        return torch.arange(lo, hi + 1)
    return torch.unique(torch.linspace(lo, hi, count).round().to(torch.int64))


def _neighbourhood(prob: BalanceProblem, order: torch.Tensor, costs: torch.Tensor, budget: int) -> torch.Tensor:
    b = prob.num_seqs
    first, last = prob.boundary_slots(order)
    ranked = torch.argsort(costs, descending=True, stable=True)
    worst, best = int(ranked[0]), int(ranked[-1])
    max_moves = max(8, budget // b)
    # Sources: slots touching the most loaded rank (the straddlers first); targets: everywhere,
    # with the slots of the least loaded rank always included.
    n_src = max(2, int(math.sqrt(max_moves / 2)))
    src = torch.unique(
        torch.cat([first[worst : worst + 1], last[worst : worst + 1], _spread(int(first[worst]), int(last[worst]), n_src)])
    )
    n_dst = max(2, max_moves // (2 * src.numel()))
    dst = torch.unique(
        torch.cat([_spread(0, b - 1, n_dst), _spread(int(first[best]), int(last[best]), max(2, n_dst // 4))])
    )
    ii, jj = torch.meshgrid(src, dst, indexing="ij")
    ii, jj = ii.flatten(), jj.flatten()
    keep = ii != jj
    ii, jj = ii[keep], jj[keep]
    if ii.numel() == 0:
        return order.view(1, -1)
    return torch.cat([_swap_orders(order, ii, jj), _move_orders(order, ii, jj), _move_orders(order, jj, ii)])


def _local_search(prob: BalanceProblem, order: torch.Tensor, costs: torch.Tensor, rounds: int, budget: int):
    for _ in range(rounds):
        cand = _neighbourhood(prob, order, costs, budget)
        cand_costs = prob.costs(cand)
        k = _pick_best(cand_costs)
        if not _better(cand_costs[k], costs):
            break
        order, costs = cand[k], cand_costs[k]
    return order, costs


def _exhaustive(prob: BalanceProblem) -> torch.Tensor:
    perms = torch.tensor(list(itertools.permutations(range(prob.num_seqs))), dtype=torch.int64)
    costs = prob.costs(perms)
    # identity is perms[0]: ties keep the plain order
    return perms[_pick_best(costs)]


# ----------------------------------------------------------------------------------------------
# public API


def balance_order(
    seqlens,
    *,
    cp_size: int,
    cost_model: str | TokenCostModel = "ds4",
    tp_size: int = 1,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    problem: BalanceProblem | None = None,
    rounds: int | None = None,
    budget: int = 1 << 15,
    exhaustive_max: int = 6,
) -> torch.Tensor:
    """Return the permutation ``order`` (int64 ``[B]``) minimising the largest per-rank cost.

    Buffer position ``k`` holds sequence ``order[k]``. ``problem`` may be given instead of the
    padding options (it carries padded lengths, e.g. taken from a layout plan). ``rounds`` bounds
    the local-search rounds (default: 2 for large batches, more for small ones); ``budget`` bounds
    the elements evaluated per round (candidates x B); batches of at most ``exhaustive_max``
    sequences are solved exactly.
    """
    prob = problem or BalanceProblem.contiguous(
        seqlens,
        cp_size=cp_size,
        cost_model=cost_model,
        tp_size=tp_size,
        min_local_rows=min_local_rows,
        pad_to_length_bucket=pad_to_length_bucket,
    )
    b = prob.num_seqs
    if prob.cp_size == 1 or b == 1:
        return torch.arange(b)
    if b <= exhaustive_max:
        return _exhaustive(prob)
    cands = _candidates(prob)
    cand_costs = prob.costs(cands)
    k = _pick_best(cand_costs)
    order, costs = cands[k], cand_costs[k]
    if rounds is None:
        rounds = max(2, min(64, (1 << 16) // (b * max(8, budget // b))))
    order, _ = _local_search(prob, order, costs, rounds, budget)
    return order


def rank_costs(
    seqlens,
    order=None,
    *,
    cp_size: int,
    cost_model: str | TokenCostModel = "ds4",
    tp_size: int = 1,
    min_local_rows: int | None = None,
    pad_to_length_bucket: int | None = None,
    problem: BalanceProblem | None = None,
) -> torch.Tensor:
    """Per-rank cost (float64 ``[cp]``) of the contiguous buffer in ``order`` (default: plain order)."""
    prob = problem or BalanceProblem.contiguous(
        seqlens,
        cp_size=cp_size,
        cost_model=cost_model,
        tp_size=tp_size,
        min_local_rows=min_local_rows,
        pad_to_length_bucket=pad_to_length_bucket,
    )
    b = prob.num_seqs
    order = torch.arange(b) if order is None else torch.as_tensor(order).to(torch.int64)
    if order.shape != (b,) or not torch.equal(torch.sort(order).values, torch.arange(b)):
        raise ValueError(f"order must be a permutation of range({b}), got {order.tolist()[:16]}...")
    return prob.costs(order)


def straggler_ratio(costs: torch.Tensor) -> float:
    """Largest per-rank cost over the mean (1.0 = perfectly balanced)."""
    costs = torch.as_tensor(costs, dtype=torch.float64)
    mean = float(costs.mean())
    return float(costs.max()) / mean if mean > 0 else 1.0


def straggler_lower_bound(prob: BalanceProblem) -> float:
    """A lower bound on the straggler ratio of *any* order (used to tell unreachable targets apart).

    Every row costs at least ``c_min = min(c(0), pad_row_cost)``. A sequence of ``n`` real tokens
    ends on some rank with its last ``l >= 1`` tokens there (``l <= L``); that rank costs at least
    ``F(n) - F(n - l) + c_min*(L - l)``, and when ``n - l >= L`` the rank before it is filled by
    the same sequence: ``F(n - l) - F(n - l - L)``. The bound is the largest, over sequences, of
    the smallest such pair maximum over ``l``, divided by the mean.
    """
    cm = prob.cost_model
    L = prob.local_rows
    mean = prob.total_cost / prob.cp_size
    c_min = min(float(cm.token_cost(torch.zeros(1))[0]), cm.pad_row_cost)
    best = 1.0
    for n in torch.unique(prob.seqlens).tolist():
        if n < 2:
            continue
        ell = torch.arange(1, min(n, L) + 1, dtype=torch.int64)
        last = cm.prefix_cost(torch.tensor(n)) - cm.prefix_cost(n - ell) + c_min * (L - ell).to(torch.float64)
        head = n - ell
        prev = torch.where(
            head >= L, cm.prefix_cost(head) - cm.prefix_cost((head - L).clamp(min=0)), torch.zeros_like(last)
        )
        bound = float(torch.maximum(last, prev).min()) / mean
        best = max(best, bound)
    return best
