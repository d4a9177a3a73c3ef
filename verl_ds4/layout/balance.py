"""Balanced contiguous CP layout: the order of sequences in the packed buffer.

DS4 accepts only equal contiguous slices of one packed buffer (rank ``r`` holds rows
``[r*L, (r+1)*L)``), padding at sequence tails. The *order* of sequences is free: it decides
which sequences land on which rank and where rank boundaries cut them. :func:`balanced_host_order`
picks the order minimising the largest per-rank cost under a :mod:`.cost` model.

Contract:
  * ``order`` is a permutation of ``range(B)``: buffer slot ``k`` holds sequence ``order[k]``. Padded
    lengths and the total row count do not depend on it (the plan restores the original order).
  * Deterministic: a pure function of the lengths and options (stable sorts, no clocks, one seeded
    generator, float64 host arithmetic). ``build_plan(..., cp_group=...)`` checks the CP ranks agree.
  * Never worse than the plain order under the cost model (the identity is always a candidate and
    a move is only accepted when it lowers the objective: max rank cost, then sum of squares).

Cost of a rank: ``c(position inside its sequence)`` per real row, ``pad_row_cost`` per padding row,
evaluated with the model's closed-form prefix sums at the ``cp - 1`` rank boundaries.

Algorithm ("excess" of a sequence: its cost minus the mean cost per row times its rows):
  1. Starts: the plain order and the excess merge (above- and below-mean sequences interleaved so
     the cumulative cost tracks the mean line), or, with many sequences (``B >= 4 cp``) one of
     which has an excess over ``_BINS_FIRST`` of a mean rank, the rank bins (:func:`_rank_bins_order`).
     With many sequences the other of the two follows when the best start is not good enough
     (the merge only while no excess is over a quarter of a mean rank). Small batches
     (``B <= _SMALL``) add longest- and shortest-first; large batches keep the best start.
  2. Small batches: best-improvement swaps and moves around the most loaded rank from the two best
     starts, then seeded restarts from perturbed copies (``B <= 64``); ``B <= _EXHAUSTIVE_MAX``:
     every order is tried.
Speed: 1024 sequences plan in under a millisecond of host CPU time (NumPy; Python loops only over
the costly sequences of the rank bins and the giants; ``benchmarks/bench_cp_balance.py``).
Exploratory constructions and a lower bound live in ``benchmarks/balance_lab.py``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .cost import TokenCostModel, get_cost_model
from .options import PlanOptions
from .types import CPLayout

__all__ = ["BalanceProblem", "balance_order", "balanced_host_order", "rank_costs", "straggler_ratio"]

_REL_TOL = 1e-12
_GOOD_ENOUGH = 1.005  # straggler ratio at which the search stops
_EXHAUSTIVE_MAX = 6  # batches up to this size try every order
_BINS_FIRST = 0.05  # excess of the costliest sequence (in mean ranks) above which the rank bins start
_SMALL = 256  # batches up to this size get the small-batch starts and the local search


def _host(values) -> np.ndarray:
    host = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if host.ndim != 1 or host.size == 0 or host.dtype.kind not in "iu":
        raise ValueError(f"sequence lengths must be a non-empty 1-D integer array, got {host.dtype} {host.shape}")
    if host.min() < 0:
        raise ValueError(f"sequence lengths must be non-negative, got a minimum of {int(host.min())}")
    return host.astype(np.int64)


@dataclass
class BalanceProblem:
    """The order-independent part of one micro-batch: lengths, padded lengths (original order),
    buffer rows (``>= padded.sum()``: the rest is tail padding), CP size and cost model. The
    balancer works on the NumPy mirrors ``real``, ``rows`` and ``cost`` (float64 per sequence)."""

    seqlens: torch.Tensor
    padded: torch.Tensor
    total_rows: int
    cp_size: int
    cost_model: TokenCostModel

    def __post_init__(self):
        self.real, self.rows = _host(self.seqlens), _host(self.padded)  # copies
        self.seqlens, self.padded = torch.from_numpy(self.real), torch.from_numpy(self.rows)
        if self.rows.shape != self.real.shape or bool((self.rows < self.real).any()):
            raise ValueError("padded lengths must have the same shape as seqlens and be >= them")
        if self.cp_size < 1 or self.total_rows % self.cp_size or self.total_rows < int(self.rows.sum()):
            raise ValueError(f"total_rows={self.total_rows} must be a multiple of cp_size={self.cp_size} >= 1 "
                             f"and >= the padded lengths' sum ({int(self.rows.sum())})")
        self.local_rows = self.total_rows // self.cp_size
        pad = self.cost_model.pad_row_cost
        self.cost = self.cost_model.prefix_cost(self.real) + pad * (self.rows - self.real)
        self.seq_cost = torch.from_numpy(self.cost)
        self.tail_rows = self.total_rows - int(self.rows.sum())
        self.total_cost = float(self.cost.sum()) + pad * self.tail_rows
        self.bounds = np.arange(1, self.cp_size, dtype=np.int64) * self.local_rows

    @classmethod
    def from_options(cls, seqlens, options: PlanOptions, cost_model: str | TokenCostModel = "ds4"):
        """The problem of a contiguous plan: padding follows ``options`` exactly as ``build_plan`` does."""
        if options.layout is not CPLayout.CONTIGUOUS:
            raise ValueError(f"sequence-order balancing needs the contiguous layout, got layout='{options.layout}'. "
                             "Zigzag already balances dense causal attention inside every sequence.")
        real = _host(seqlens)
        padded = real + (-real) % options.sequence_alignment
        return cls(real, padded, options.padded_total(int(padded.sum())), options.cp_size, get_cost_model(cost_model))

    @classmethod
    def contiguous(cls, seqlens, *, cp_size: int, cost_model: str | TokenCostModel = "ds4", **padding):
        """:meth:`from_options` with ``PlanOptions(layout="contiguous", cp_size=..., **padding)``."""
        return cls.from_options(seqlens, PlanOptions(layout=CPLayout.CONTIGUOUS, cp_size=cp_size, **padding), cost_model)

    @property
    def num_seqs(self) -> int:
        return int(self.real.shape[0])

    def costs(self, orders) -> torch.Tensor:
        """Per-rank costs ``[K, cp]`` (float64) for orders ``[K, B]`` (``[cp]`` for one ``[B]``)."""
        o = np.asarray(orders, dtype=np.int64)
        out = self.costs_np(o.reshape(1, -1) if o.ndim == 1 else o)
        return torch.from_numpy(out[0] if o.ndim == 1 else out)

    def costs_np(self, orders: np.ndarray) -> np.ndarray:
        """:meth:`costs` on the host: int64 ``[K, B]`` -> float64 ``[K, cp]``."""
        k, b = orders.shape
        if self.cp_size == 1:
            return np.full((k, 1), self.total_cost)
        zero = np.zeros((k, 1))
        cum_rows = np.concatenate([zero.astype(np.int64), np.cumsum(self.rows[orders], axis=1)], 1)
        cum_cost = np.concatenate([zero, np.cumsum(self.cost[orders], axis=1)], 1)
        # one binary search for all K orders: row k of cum_rows is shifted by k * (total_rows + 1)
        base = np.arange(k, dtype=np.int64)[:, None]
        x = self.bounds[None, :]
        shift = base * (self.total_rows + 1)
        at = (np.searchsorted((cum_rows + shift).ravel(), (x + shift).ravel(), side="right") - 1).reshape(k, -1)
        idx = at - base * (b + 1)  # slot holding row x (b: the tail padding)
        seq = orders.ravel()[np.minimum(idx, b - 1) + base * b]
        off = x - cum_rows.ravel()[at]
        pad = self.cost_model.pad_row_cost
        g = np.where(idx >= b, cum_cost[:, -1:] + pad * off, cum_cost.ravel()[at] + self.partial(self.real[seq], off))
        return np.diff(np.concatenate([zero, g, zero + self.total_cost], 1), axis=1)

    def partial(self, real: np.ndarray, off: np.ndarray) -> np.ndarray:
        """Cost of the first ``off`` rows of sequences with ``real`` tokens (then padding rows)."""
        r = np.minimum(off, real)
        return self.cost_model.prefix_cost(r) + self.cost_model.pad_row_cost * (off - r)


def _pick_best(costs: np.ndarray) -> int:
    """Index of the lexicographically best (max, sum of squares) row of ``costs [K, cp]``."""
    mx, sq = costs.max(1), (costs * costs).sum(1)
    return int(np.argmin(np.where(mx <= mx.min() * (1 + _REL_TOL), sq, np.inf)))


def _better(a: np.ndarray, b: np.ndarray) -> bool:
    """Is cost vector ``a`` strictly better than ``b`` (lexicographic max, then sum of squares)?"""
    ma, mb = float(a.max()), float(b.max())
    return ma < mb * (1 - _REL_TOL) or (ma <= mb * (1 + _REL_TOL) and float(a @ a) < float(b @ b) * (1 - _REL_TOL))


def _desc(values: np.ndarray) -> np.ndarray:
    return np.argsort(-values, kind="stable")  # descending, ties in index order


def _excess_merge_order(excess: np.ndarray) -> np.ndarray:
    """Interleave above- and below-mean sequences (each largest first) by the midpoint of their
    share of their group's cumulative excess, so the cumulative cost tracks the mean line."""
    by_size = _desc(np.abs(excess))
    above = excess[by_size] >= 0
    groups, keys = [by_size[above], by_size[~above]], []
    for ids in groups:
        mag = np.abs(excess[ids])
        total = float(mag.sum())
        keys.append((np.arange(ids.size) + 0.5) / max(ids.size, 1) if total <= 0 else (np.cumsum(mag) - mag / 2) / total)
    out = np.empty(excess.size, dtype=np.int64)
    out[np.arange(groups[0].size) + np.searchsorted(keys[1], keys[0], side="left")] = groups[0]
    out[np.arange(groups[1].size) + np.searchsorted(keys[0], keys[1], side="right")] = groups[1]
    return out


def _rank_bins_order(prob: BalanceProblem, giant: float = 0.9, big: float = 0.002, reach: int = 8) -> np.ndarray:
    """Fill the ``cp`` ranks as bins (rows and cost), then concatenate them: for many sequences.

    Filler: the sequences costing at most ``big`` of a mean rank, ``rho`` their cost per row. A rank's
    room is its budget left once its free rows hold filler at ``rho``; a sequence takes ``cost - rho *
    rows`` of it. Giants (over ``giant`` of an empty rank's room, at most ``cp - 1``) straddle evenly
    spread boundaries, cut where their two ranks have the same room left (where the left one is full
    when the next boundary cuts a giant too); the other non-filler go, costliest first, to the rank with
    the most room (a heap); the filler, in excess-merge order, fill the remaining rows; inside a rank the
    shortest sit at both edges; each giant then slides among its ``2 reach`` neighbours (:func:`_slide_giants`)."""
    cp, L, rows, cost = prob.cp_size, prob.local_rows, prob.rows, prob.cost
    tau = prob.total_cost / cp
    tail = (np.arange(cp) == cp - 1) * prob.tail_rows  # the last rank holds the tail padding
    left, budget = L - tail.astype(float), tau - tail * prob.cost_model.pad_row_cost  # rows and cost left
    is_filler = cost <= big * tau
    desc = _desc(np.where(is_filler, -np.inf, cost))[: int((~is_filler).sum())]  # non-filler, costliest first
    rho = float(cost[is_filler].sum()) / max(float(rows[is_filler].sum()), 1.0)
    takes = cost - rho * rows  # room a sequence takes
    top = desc[: cp - 1]
    top = top[(takes[top] > giant * (tau - L * rho)) & (rows[top] > 1) & (rows[top] <= L)]
    head = np.full(cp, -1, dtype=np.int64)  # giant cut by the boundary after rank b
    head[((np.arange(top.size) + 0.5) * (cp - 1) / max(top.size, 1)).astype(np.int64)] = top  # distinct
    cut_at = np.flatnonzero(head >= 0).tolist()
    for b in cut_at:  # left to right: a rank may hold a giant's tail already
        i = int(head[b])
        room_b, room_next = budget[b : b + 2] - left[b : b + 2] * rho
        share = room_b if head[b + 1] >= 0 else (takes[i] + room_b - room_next) / 2
        t, head_cost = _giant_cut(prob, i, rho, share)
        left[b : b + 2] -= (t, rows[i] - t)
        budget[b : b + 2] -= (head_cost, cost[i] - head_cost)
    bigs = desc[~np.isin(desc, top)]
    room = [(-float(budget[b] - left[b] * rho), b) for b in range(cp)]  # heap: most room first, then lower rank
    heapq.heapify(room)
    left, to, big_rows = left.tolist(), [], rows[bigs]
    fewest = np.minimum.accumulate(big_rows[::-1])[::-1].tolist()  # fewest rows of any big still to come
    for r, x, low in zip(big_rows.tolist(), takes[bigs].tolist(), fewest):
        fits = room and left[room[0][1]] >= r  # the rank with the most room has the rows (heapreplace: its old entry)
        b = heapq.heapreplace(room, (room[0][0] + x, room[0][1]))[1] if fits else _take_with_rows(room, left, r, x, low)
        left[b] -= r
        to.append(b)
    bin_of = np.full(rows.shape[0], -1, dtype=np.int64)
    bin_of[bigs] = to
    filler = np.flatnonzero(is_filler)
    sub, sub_rows = cost[filler], rows[filler]
    filler = filler[_excess_merge_order(sub - float(sub.sum()) / max(float(sub_rows.sum()), 1.0) * sub_rows)]
    mid = np.cumsum(rows[filler]) - rows[filler] / 2
    bin_of[filler] = np.minimum(np.searchsorted(np.cumsum(np.maximum(left, 0.0)), mid, side="right"), cp - 1)
    members = np.flatnonzero(bin_of >= 0)
    members = members[np.lexsort((rows[members], bin_of[members]))]  # by bin, rows, index
    bins = np.split(members, np.cumsum(np.bincount(bin_of[members], minlength=cp))[:-1])
    ends = [head[b : b + 1] if head[b] >= 0 else m[:0] for b, m in enumerate(bins)]  # a giant ends its left rank
    parts = [np.concatenate([m[0::2], m[1::2][::-1], e]) for m, e in zip(bins, ends)]
    slots = (np.cumsum([p.size for p in parts]) - 1)[head >= 0].tolist()
    order = np.concatenate(parts)
    return _slide_giants(prob, order, cut_at, slots, reach) if cut_at else order


def _giant_cut(prob: BalanceProblem, i: int, rho: float, share: float) -> tuple[int, float]:
    """Rows ``t`` (``1 <= t < rows``) of giant ``i`` on the left rank and their cost ``F(t)``, with
    ``h(t) = F(t) - rho t - share`` nearest 0 (``h`` is convex: a coarse grid, then row by row)."""
    p, real = int(prob.rows[i]), prob.real[i : i + 1]
    grid = 1 + np.arange(65) * (p - 2) // 64  # 1 .. p - 1, non-decreasing
    k = min(int(np.searchsorted(prob.partial(real, grid) - rho * grid >= share, True)), grid.size - 1)
    t = np.arange(grid[max(k - 1, 0)], grid[k] + 1, dtype=np.int64)  # from the grid point before h >= 0
    head_cost = prob.partial(real, t)
    best = int(np.argmin(np.abs(head_cost - rho * t - share)))
    return int(t[best]), float(head_cost[best])


def _take_with_rows(room: list, left: list, r: int, x: float, low: int) -> int:
    """The rank with the most room among those with ``r`` rows left (else the most rows left); the
    heap ``room`` of ``(-room, rank)`` is rebuilt from the ranks with ``low`` rows left."""
    fit = [e for e in room if left[e[1]] >= r]
    k, b = min(fit) if fit else (0.0, max(range(len(left)), key=left.__getitem__))  # (then b is full: k unused)
    room[:] = [e for e in room if e[1] != b and left[e[1]] >= low] + ([(k + x, b)] if left[b] - r >= low else [])
    heapq.heapify(room)
    return b


def _slide_giants(prob: BalanceProblem, order: np.ndarray, bounds: list, slots: list, reach: int) -> np.ndarray:
    """Re-cut each giant (at ``slots[k]``, cut after rank ``bounds[k]``) by moving it to the place
    among its ``2 reach`` neighbours that minimises the larger of its two ranks' costs. Giants go
    last first so windows do not overlap; a window reaching a third rank is skipped."""
    n, L = prob.num_seqs, prob.local_rows
    cum_rows = np.concatenate([[0], np.cumsum(prob.rows[order])])
    rank = prob.costs_np(order[None, :])[0].tolist()
    window_end = n  # a window must end where the window processed before it begins
    for s, b in sorted(zip(slots, bounds), reverse=True):  # last giant first: earlier slots keep their rows
        g, lo, hi = int(order[s]), max(s - reach, 0), min(s + reach + 1, n)
        p, t_now = int(prob.rows[g]), int((b + 1) * L - cum_rows[s])  # giant rows on the left rank
        if not 0 < t_now < p or cum_rows[lo] < b * L or cum_rows[hi] > (b + 2) * L or hi > window_end:
            continue  # not cut by its boundary, or the window reaches a third rank or another window
        window_end = lo
        window = np.concatenate([order[lo:s], order[s + 1 : hi]])
        pre_rows = np.concatenate([[0], np.cumsum(prob.rows[window])])
        pre_cost = np.concatenate([[0.0], np.cumsum(prob.cost[window])])
        t = (b + 1) * L - int(cum_rows[lo]) - pre_rows  # giant rows on the left rank after j neighbours
        f = prob.partial(prob.real[g : g + 1], np.clip(t, 0, p))  # F(t): the giant's head
        shift = pre_cost + f - (pre_cost[s - lo] + f[s - lo])  # cost moving from the right rank to the left
        lhs, rhs = rank[b] + shift, rank[b + 1] - shift
        worse = np.where((t > 0) & (t < p), np.maximum(lhs, rhs), np.inf)
        j = int(worse.argmin())
        if worse[j] < max(rank[b], rank[b + 1]) * (1 - _REL_TOL):
            order = order.copy()
            order[lo:hi] = np.concatenate([window[:j], [g], window[j:]])
            rank[b], rank[b + 1] = float(lhs[j]), float(rhs[j])  # adjacent giants share a rank
    return order


def _moved_index(b: int, i: np.ndarray, j: np.ndarray, swap: np.ndarray) -> np.ndarray:
    """``[K, B]``: slot ``p`` of candidate ``k`` takes the sequence of old slot ``out[k, p]`` (slots
    ``i`` and ``j`` swapped, or the sequence of slot ``i`` moved to slot ``j``)."""
    p, i, j, swap = np.arange(b)[None, :], i[:, None], j[:, None], swap[:, None]
    lo, hi = np.minimum(i, j), np.maximum(i, j)
    shift = np.where((p >= lo) & (p <= hi), np.where(i < j, 1, -1), 0)  # a move shifts the slots between
    out = np.where(p == j, i, np.where(swap, p, p + shift))
    return np.where(swap & (p == i), j, out)


def _local_search(prob, order, costs, rounds: int, max_moves: int, good_enough: float):
    """Best-improvement rounds over swaps and moves (either way) between sources evenly spread over
    the slots of the most loaded rank (all when few) and targets spread over the buffer, each
    candidate evaluated in full."""
    b, L, mean = prob.num_seqs, prob.local_rows, prob.total_cost / prob.cp_size
    for _ in range(rounds):
        if float(costs.max()) <= mean * good_enough:
            break
        worst, cum = int(costs.argmax()), np.cumsum(prob.rows[order])
        first, last = np.minimum(np.searchsorted(cum, [worst * L, (worst + 1) * L - 1], side="right"), b - 1).tolist()
        src = np.unique(np.linspace(first, last, max(4, int(math.sqrt(max_moves / 3)))).round().astype(np.int64))
        dst = np.unique(np.linspace(0, b - 1, max(4, max_moves // (3 * src.size))).round().astype(np.int64))
        ii, jj = np.repeat(src, dst.size), np.tile(dst, src.size)
        ii, jj = ii[ii != jj], jj[ii != jj]
        i, j = np.concatenate([ii, ii, jj]), np.concatenate([jj, jj, ii])
        cands = order[_moved_index(b, i, j, np.arange(i.size) < ii.size)]
        cand_costs = prob.costs_np(cands)
        k = _pick_best(cand_costs)
        if not _better(cand_costs[k], costs):
            break
        order, costs = cands[k], cand_costs[k]
    return order, costs


def _balance(prob: BalanceProblem, rounds=None, max_moves=None, good_enough=_GOOD_ENOUGH, kicks=None,
             exhaustive_max=_EXHAUSTIVE_MAX) -> np.ndarray:
    """The module docstring's algorithm on the host; ``None`` picks a default."""
    b, cp = prob.num_seqs, prob.cp_size
    if cp == 1 or b == 1 or prob.total_cost <= 0:  # nothing to balance (e.g. only empty sequences)
        return np.arange(b)
    if b <= exhaustive_max:
        perms = np.asarray(list(itertools.permutations(range(b))), dtype=np.int64)
        return perms[_pick_best(prob.costs_np(perms))]  # the identity first: ties keep the plain order
    mean = prob.total_cost / cp
    excess = prob.cost - (prob.total_cost / prob.total_rows) * prob.rows
    many, small, top = b >= 4 * cp, b <= _SMALL, float(excess.max())
    bins_first = many and top > _BINS_FIRST * mean  # the merge rarely cuts such a sequence well
    cands = [np.arange(b), _rank_bins_order(prob) if bins_first else _excess_merge_order(excess)]
    if small:
        cands += [_desc(prob.rows), _desc(prob.rows)[::-1].copy()]
    cand_costs = prob.costs_np(np.stack(cands))
    if many and float(cand_costs.max(1).min()) > mean * good_enough and (not bins_first or top <= 0.25 * mean):
        cands.append(_excess_merge_order(excess) if bins_first else _rank_bins_order(prob))  # the other start
        cand_costs = np.concatenate([cand_costs, prob.costs_np(cands[-1][None, :])])
    ranked = sorted(range(len(cands)), key=lambda k: (float(cand_costs[k].max()), k))
    if not small:  # large batches keep the best start
        return cands[ranked[0]]
    rounds = max(4, min(48, 4096 // b)) if rounds is None else rounds
    max_moves = max(192, min(3072, (1 << 17) // b)) if max_moves is None else max_moves
    kicks = (0 if b > 64 else min(32, 512 // b)) if kicks is None else kicks
    rng = np.random.Generator(np.random.PCG64(0x5EED))
    order, costs = cands[ranked[0]], cand_costs[ranked[0]]
    # local search from the two best starts (a better start can end in a worse optimum), then from the
    # best order perturbed by two seeded random moves (iterated local search)
    for k in range(2 + kicks):
        if k >= 2 and float(costs.max()) <= mean * good_enough:
            break
        start = cands[ranked[k]] if k < 2 else order
        for _ in range(2 if k >= 2 else 0):
            i, j = rng.integers(0, b, 2).tolist()
            if i != j:
                start = start[_moved_index(b, np.array([i]), np.array([j]), np.array([rng.random() < 0.5]))[0]]
        o, c = _local_search(prob, start, prob.costs_np(start[None, :])[0], rounds if k < 2 else min(rounds, 16),
                             max_moves, good_enough)
        if _better(c, costs):
            order, costs = o, c
    return order


def balanced_host_order(host_seqlens: np.ndarray, options: PlanOptions, cost_model=None) -> np.ndarray:
    """The order ``build_plan`` uses when ``options.balance`` is set: int64 NumPy ``[B]``, buffer
    slot ``k`` holds sequence ``order[k]``; from host int64 lengths (``>= 0``). ``cost_model``
    (a name or a :class:`TokenCostModel`) defaults to ``options.balance``."""
    model = cost_model or options.balance or "ds4"
    return _balance(BalanceProblem.from_options(np.asarray(host_seqlens, dtype=np.int64), options, model))


def balance_order(seqlens, *, cp_size: int, cost_model: str | TokenCostModel = "ds4",
                  problem: BalanceProblem | None = None, **search) -> torch.Tensor:
    """:func:`balanced_host_order` as an int64 tensor, for ``PlanOptions(layout="contiguous",
    cp_size=...)`` (padding options such as ``min_local_rows`` may be passed as keywords) or a
    given ``problem``. Search keywords (``rounds``, ``max_moves``, ``good_enough``, ``kicks``,
    ``exhaustive_max``) override the defaults (benchmarks)."""
    keys = {"rounds", "max_moves", "good_enough", "kicks", "exhaustive_max"}
    padding = {k: v for k, v in search.items() if k not in keys}
    prob = problem or BalanceProblem.contiguous(seqlens, cp_size=cp_size, cost_model=cost_model, **padding)
    return torch.from_numpy(_balance(prob, **{k: v for k, v in search.items() if k in keys}))


def rank_costs(seqlens, order=None, *, cp_size: int, cost_model: str | TokenCostModel = "ds4",
               problem: BalanceProblem | None = None, **padding) -> torch.Tensor:
    """Per-rank cost (float64 ``[cp]``) of the contiguous buffer in ``order`` (default: plain order)."""
    prob = problem or BalanceProblem.contiguous(seqlens, cp_size=cp_size, cost_model=cost_model, **padding)
    b = prob.num_seqs
    order = torch.arange(b) if order is None else torch.as_tensor(order).to(torch.int64)
    if order.shape != (b,) or not torch.equal(torch.sort(order).values, torch.arange(b)):
        raise ValueError(f"order must be a permutation of range({b}), got {order.tolist()[:16]}...")
    return prob.costs(order)


def straggler_ratio(costs) -> float:
    """Largest per-rank cost over the mean (1.0 = perfectly balanced)."""
    costs = torch.as_tensor(costs, dtype=torch.float64)
    mean = float(costs.mean())
    return float(costs.max()) / mean if mean > 0 else 1.0
