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
    unseeded randomness, stable sorts, float64 host arithmetic), because every CP rank computes
    the plan on its own and all must agree. Ranks are assumed to run the same NumPy build on the
    same kind of CPU.
  * Never worse than the plain order under the chosen cost model: the identity order is always
    a candidate and a move is only accepted when it lowers the objective.

Cost of a rank: each of its rows costs ``c(position inside its sequence)``; padding rows cost
``pad_row_cost``. A sequence straddling a boundary therefore splits its cost by position (its
cheap head on the left rank, its expensive tail on the right one). Costs are evaluated with
closed-form prefix sums at the ``cp - 1`` boundaries only, batched over candidate orders.

Speed: planning runs on the host in NumPy (many small array operations, a few microseconds
each; tensors cost more per operation). 1024 sequences plan in under 1 ms at CP 2-16 under both
cost models (``benchmarks/bench_cp_balance.py``). Python loops run over the sequences of small
batches only, over the costly sequences of the rank bins (a heap, well under a microsecond
each), and over the few giants.

Algorithm. "Excess" of a sequence: its cost minus the mean cost per row times its rows.
  1. Constructions. Many sequences (``B >= 4 cp``) with one whose excess is over
     ``_BINS_FIRST`` of a mean rank (dense attention with heavy-tailed lengths): the rank bins
     (:func:`_rank_bins_order`) first: giants straddle rank boundaries at the cut where their two
     ranks cost the same, the other costly sequences are dealt greedily to the ranks with the
     most room, the short ones fill the remaining rows, and each giant's cut is finally tuned by
     choosing which of its short neighbours stand before it. Otherwise: the plain order and an
     "excess merge" that interleaves above-mean and below-mean sequences so the cumulative cost
     tracks the straight line from 0 to the total (boundaries then cut near ``r * mean``); the
     rank bins follow when those do not reach ``good_enough``. Small batches (``B <= 256``) also try longest-first, a
     snake partition by cost, shortest-first and the heavy-sequence constructions (a balancing
     walk cutting heavy sequences half-way through their excess, or where their two ranks cost
     the same with the cheapest sequences reserved for them). The best start is kept.
  2. Local search (small batches, and large ones holding a sequence longer than a rank, which
     the rank bins cannot place; other large batches stop after the constructions):
     best-improvement over swap and move (remove + insert) neighbourhoods around the most loaded rank, objective
     (max rank cost, then sum of squares), each candidate evaluated incrementally in O(cp).
  3. Small batches: seeded restarts from perturbed copies of the best order (iterated local
     search); tiny batches (``B <= exhaustive_max``): all ``B!`` orders are evaluated (optimal).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from verl_ds4.layout.cost import TokenCostModel, get_cost_model
from verl_ds4.layout.options import PlanOptions
from verl_ds4.layout.types import CPLayout

__all__ = [
    "BalanceProblem",
    "balance_order",
    "balanced_host_order",
    "rank_costs",
    "straggler_ratio",
    "straggler_lower_bound",
]

_REL_TOL = 1e-12
_GOOD_ENOUGH = 1.005  # straggler ratio at which the search stops
_EXHAUSTIVE_MAX = 6  # batches up to this size are solved by trying every order
_BINS_FIRST = 0.05  # excess of the costliest sequence (in mean ranks) above which the rank bins go first
_SMALL = 256  # batches up to this size try every constructive start (their local search is cheap too)


def _as_lengths(seqlens) -> np.ndarray:
    """Validated host lengths (int64 copy) from a tensor, an array or a sequence."""
    if isinstance(seqlens, torch.Tensor):
        dtype, kind = seqlens.dtype, "f" if seqlens.dtype.is_floating_point or seqlens.dtype == torch.bool else "i"
        host = seqlens.detach().cpu().numpy()
    else:
        host = np.asarray(seqlens)
        dtype, kind = host.dtype, "i" if host.dtype.kind in "iu" else "f"
    if host.ndim != 1 or host.size == 0:
        raise ValueError(f"seqlens must be a non-empty 1-D tensor of sequence lengths, got shape {tuple(host.shape)}")
    if kind != "i":
        raise ValueError(f"seqlens must be integers, got dtype {dtype}")
    host = host.astype(np.int64)
    if host.min() < 0:
        raise ValueError(f"sequence lengths must be non-negative, got a minimum of {int(host.min())}")
    return host


def _host_copy(values) -> np.ndarray:
    """An int64 NumPy copy of a tensor, an array or a sequence."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy().astype(np.int64)
    return np.array(values, dtype=np.int64)


@dataclass
class BalanceProblem:
    """Everything order-independent about one micro-batch: lengths, padding, per-sequence cost.

    ``padded`` are the per-sequence padded lengths in *original* order and ``total_rows`` the
    buffer length (``>= padded.sum()``; the difference is tail padding after the last sequence).
    The tensors are the public view; the balancer works on NumPy mirrors of them (``rows``,
    ``real``, ``cost``), because its many small operations cost a few microseconds less each
    there than as tensor operations.
    """

    seqlens: torch.Tensor  # int64 [B] (an array or a list is taken too; kept as a view of the host copy)
    padded: torch.Tensor  # int64 [B]
    total_rows: int
    cp_size: int
    cost_model: TokenCostModel

    def __post_init__(self):
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        self.real = _host_copy(self.seqlens)  # copies: the caller may reuse its tensors
        self.rows = _host_copy(self.padded)
        self.seqlens, self.padded = torch.from_numpy(self.real), torch.from_numpy(self.rows)
        if self.rows.shape != self.real.shape or bool((self.rows < self.real).any()):
            raise ValueError("padded lengths must have the same shape as seqlens and be >= them")
        padded_sum = int(self.rows.sum())
        if self.total_rows % self.cp_size or self.total_rows < padded_sum:
            raise ValueError(
                f"total_rows={self.total_rows} must be a multiple of cp_size={self.cp_size} and >= the sum of "
                f"padded lengths ({padded_sum})"
            )
        self.local_rows = self.total_rows // self.cp_size
        pad = self.cost_model.pad_row_cost
        self.cost = self.cost_model.prefix_cost(self.real) + pad * (self.rows - self.real)
        self.seq_cost = torch.from_numpy(self.cost)
        self.tail_rows = self.total_rows - padded_sum
        self.total_cost = float(self.cost.sum()) + pad * self.tail_rows
        self.bounds = np.arange(1, self.cp_size, dtype=np.int64) * self.local_rows

    @classmethod
    def from_options(
        cls, seqlens, options: PlanOptions, cost_model: str | TokenCostModel = "ds4"
    ) -> "BalanceProblem":
        """The problem of a contiguous plan: padding follows ``options`` exactly as ``build_plan`` does."""
        return cls.from_host(_as_lengths(seqlens), options, cost_model)

    @classmethod
    def from_host(cls, real: np.ndarray, options: PlanOptions, cost_model: str | TokenCostModel = "ds4"):
        """:meth:`from_options` for validated host lengths (int64, ``>= 0``): no tensor is read."""
        if options.layout is not CPLayout.CONTIGUOUS:
            raise ValueError(
                f"sequence-order balancing needs the contiguous layout, got layout='{options.layout}'. "
                "Zigzag already balances dense causal attention inside every sequence."
            )
        unit = options.sequence_alignment
        padded = real + (-real) % unit
        total = options.padded_total(int(padded.sum()))
        return cls(real, padded, total, options.cp_size, get_cost_model(cost_model))

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
        fp8_padding: bool = False,
    ) -> "BalanceProblem":
        options = PlanOptions(
            layout=CPLayout.CONTIGUOUS,
            tp_size=tp_size,
            cp_size=cp_size,
            min_local_rows=min_local_rows,
            pad_to_length_bucket=pad_to_length_bucket,
            fp8_padding=fp8_padding,
        )
        return cls.from_options(seqlens, options, cost_model)

    @property
    def num_seqs(self) -> int:
        return int(self.real.shape[0])

    def costs(self, orders) -> torch.Tensor:
        """Per-rank costs ``[K, cp]`` (float64) for a batch of orders ``[K, B]`` (or ``[cp]`` for ``[B]``)."""
        o = np.asarray(orders, dtype=np.int64)
        out = self.costs_np(o.reshape(1, -1) if o.ndim == 1 else o)
        return torch.from_numpy(out[0] if o.ndim == 1 else out)

    def costs_np(self, orders: np.ndarray) -> np.ndarray:
        """:meth:`costs` on the host: ``orders`` int64 ``[K, B]`` -> float64 ``[K, cp]``."""
        k, b = orders.shape
        cp = self.cp_size
        if cp == 1:
            return np.full((k, 1), self.total_cost)
        cum_rows = np.zeros((k, b + 1), dtype=np.int64)
        np.cumsum(self.rows[orders], axis=1, out=cum_rows[:, 1:])
        cum_cost = np.zeros((k, b + 1))
        np.cumsum(self.cost[orders], axis=1, out=cum_cost[:, 1:])
        # one binary search for all K orders: row k of cum_rows is shifted by k * (total_rows + 1)
        base = np.arange(k, dtype=np.int64)[:, None]
        x = self.bounds[None, :]
        flat_rows = (cum_rows + base * (self.total_rows + 1)).ravel()
        found = np.searchsorted(flat_rows, (x + base * (self.total_rows + 1)).ravel(), side="right") - 1
        at = found.reshape(k, cp - 1)  # flat index of the slot holding row x (slot b = the tail)
        idx = at - base * (b + 1)
        seq = orders.ravel()[np.minimum(idx, b - 1) + base * b]
        off = x - cum_rows.ravel()[at]
        before = cum_cost.ravel()[at]
        pad = self.cost_model.pad_row_cost
        g = np.where(idx >= b, cum_cost[:, -1:] + pad * off, before + self.partial(self.real[seq], off))
        return _rank_diff(g, self.total_cost)

    def partial(self, real: np.ndarray, off: np.ndarray) -> np.ndarray:
        """Cost of the first ``off`` rows of sequences with ``real`` tokens (then padding rows)."""
        r = np.minimum(off, real)
        return self.cost_model.prefix_cost(r) + self.cost_model.pad_row_cost * (off - r)

    def boundary_slots(self, order) -> tuple[torch.Tensor, torch.Tensor]:
        """For one order: buffer slots of the first and last sequence touching each rank ``[cp]`` each."""
        first, last = self._boundary_slots(np.asarray(order, dtype=np.int64))
        return torch.from_numpy(first), torch.from_numpy(last)

    def _boundary_slots(self, order: np.ndarray, cum_rows: np.ndarray | None = None):
        if cum_rows is None:
            cum_rows = np.concatenate([[0], np.cumsum(self.rows[order])])
        starts = np.arange(self.cp_size, dtype=np.int64) * self.local_rows
        first = np.searchsorted(cum_rows, starts, side="right") - 1
        last = np.searchsorted(cum_rows, starts + self.local_rows - 1, side="right") - 1
        b = self.num_seqs
        return np.minimum(first, b - 1), np.minimum(last, b - 1)


def _rank_diff(g: np.ndarray, total: float) -> np.ndarray:
    """Per-rank costs from the cumulative cost ``g [K, cp-1]`` at the inner rank boundaries."""
    k = g.shape[0]
    full = np.empty((k, g.shape[1] + 2))
    full[:, 0] = 0.0
    full[:, 1:-1] = g
    full[:, -1] = total
    return np.diff(full, axis=1)


def _pick_best(costs: np.ndarray) -> int:
    """Index of the lexicographically best (max, sum of squares) row of ``costs [K, cp]``."""
    mx = costs.max(1)
    sq = (costs * costs).sum(1)
    near = mx <= mx.min() * (1 + _REL_TOL)
    return int(np.argmin(np.where(near, sq, np.inf)))


def _better(a: np.ndarray, b: np.ndarray) -> bool:
    """Is cost vector ``a`` strictly better than ``b`` (lexicographic max, then sum of squares)?"""
    ma, sa = float(a.max()), float(a @ a)
    mb, sb = float(b.max()), float(b @ b)
    if ma < mb * (1 - _REL_TOL):
        return True
    return ma <= mb * (1 + _REL_TOL) and sa < sb * (1 - _REL_TOL)


def _desc(values: np.ndarray) -> np.ndarray:
    """Indices sorting ``values`` descending, ties in index order."""
    return np.argsort(-values, kind="stable")


# ----------------------------------------------------------------------------------------------
# constructive candidates


def _excess_merge_order_of(prob: BalanceProblem, ids: np.ndarray) -> np.ndarray:
    """:func:`_excess_merge_order` of the subset ``ids`` (positions into ``ids``), around its own mean."""
    rows = prob.rows[ids].astype(np.float64)
    sub = prob.cost[ids]
    return _excess_merge_order(sub - float(sub.sum()) / max(float(rows.sum()), 1.0) * rows)


def _excess_merge_order(excess: np.ndarray) -> np.ndarray:
    """Interleave above-mean and below-mean sequences so cumulative cost tracks the mean line.

    Each group, largest excess first (ties in index order), is spread over ``[0, 1]`` by its
    cumulative excess (the midpoint of each sequence's share); the two groups are then merged by
    that key, the above-mean one first on ties. Both keys increase, so the merge is a search.
    """
    by_size = _desc(np.abs(excess))
    above = excess[by_size] >= 0
    groups, keys = [], []
    for ids in (by_size[above], by_size[~above]):
        mag = np.abs(excess[ids])
        total = float(mag.sum())
        key = (np.arange(ids.size) + 0.5) / max(ids.size, 1) if total <= 0 else (np.cumsum(mag) - mag / 2) / total
        groups.append(ids)
        keys.append(key)
    out = np.empty(excess.size, dtype=np.int64)
    out[np.arange(groups[0].size) + np.searchsorted(keys[1], keys[0], side="left")] = groups[0]
    out[np.arange(groups[1].size) + np.searchsorted(keys[0], keys[1], side="right")] = groups[1]
    return out


def _snake_order(prob: BalanceProblem) -> np.ndarray:
    """Snake-assign sequences sorted by cost to ``cp`` groups and concatenate the groups."""
    cp, b = prob.cp_size, prob.num_seqs
    srt = _desc(prob.cost)
    i = np.arange(b)
    rnd, pos = i // cp, i % cp
    group = np.where(rnd % 2 == 0, pos, cp - 1 - pos)
    return srt[np.argsort(group * b + i, kind="stable")]


def _excess(prob: BalanceProblem) -> np.ndarray:
    """Per-sequence cost above the mean row cost times its rows (negative: cheaper than average)."""
    return prob.cost - (prob.total_cost / prob.total_rows) * prob.rows


def _heavy(prob: BalanceProblem, threshold: float, excess: np.ndarray) -> np.ndarray:
    """Up to ``cp - 1`` sequences whose excess is above ``threshold`` of a mean rank, largest first."""
    heavy = _desc(excess)[: prob.cp_size - 1]
    return heavy[excess[heavy] > threshold * prob.total_cost / prob.cp_size]


def _spread_bounds(m: int, cp: int) -> np.ndarray:
    """``m`` rank boundaries (1 .. cp-1) spread evenly."""
    return np.floor((np.arange(m) + 0.5) * (cp - 1) / m).astype(np.int64) + 1


def _heavy_walk_order(prob: BalanceProblem, threshold: float, excess: np.ndarray) -> np.ndarray | None:
    """Cut heavy sequences at rank boundaries, and fill around them with a balancing walk.

    A sequence is heavy when its excess (cost above the mean row cost times its rows) is more
    than ``threshold`` of a mean rank. Up to ``cp - 1`` heavy sequences are assigned to distinct,
    evenly spread boundaries and placed so the boundary cuts each where half its excess is on
    either side. The other sequences follow a walk that keeps the cumulative deviation from the
    mean line at its target: a below-mean sequence next when ahead, an above-mean one when
    behind; the target is ``-excess/2`` just before a heavy sequence and 0 elsewhere.
    Returns ``None`` when nothing is heavy. Python loop over sequences: used for small batches.
    """
    cp, b, L = prob.cp_size, prob.num_seqs, prob.local_rows
    mean_row = prob.total_cost / prob.total_rows
    heavy = _heavy(prob, threshold, excess)
    m = heavy.size
    if m == 0:
        return None
    # where half of each heavy sequence's excess is reached (grid search, one batched call)
    hp = prob.rows[heavy][:, None]
    t = np.round(np.linspace(0.0, 1.0, 1025)[None, :] * hp).astype(np.int64)
    dev = prob.partial(prob.real[heavy][:, None], t) - mean_row * t
    cut = np.take_along_axis(t, np.abs(dev - excess[heavy][:, None] / 2).argmin(1)[:, None], 1).ravel()
    cut = np.maximum(np.minimum(cut, hp.ravel() - 1), 1)
    bounds = _spread_bounds(m, cp)

    rows, ex = prob.rows.tolist(), excess.tolist()
    is_heavy = np.zeros(b, dtype=bool)
    is_heavy[heavy] = True
    rest = np.flatnonzero(~is_heavy)
    light = rest[excess[rest] < 0]
    light = light[np.argsort(excess[light], kind="stable")].tolist()  # most negative first
    dense = rest[excess[rest] >= 0]
    dense = dense[_desc(excess[dense])].tolist()
    out: list[int] = []
    x, d = 0, 0.0  # rows placed, cumulative deviation from the mean line
    li = di = 0
    for h, c, r, e in zip(heavy.tolist(), cut.tolist(), bounds.tolist(), excess[heavy].tolist()):
        start = max(r * L - c, x)  # where h must start so boundary r cuts it after c rows (if still ahead)
        target = -e / 2
        while x < start:
            if (d > target and li < len(light)) or di >= len(dense):
                if li >= len(light):
                    break
                f, take_light = light[li], True
            else:
                f, take_light = dense[di], False
            if x + rows[f] > start and (x + rows[f] - start) > (start - x):
                break  # placing f would overshoot the cut point more than stopping here
            out.append(f)
            x += rows[f]
            d += ex[f]
            li, di = (li + 1, di) if take_light else (li, di + 1)
        out.append(h)
        x += rows[h]
        d += e
    while li < len(light) or di < len(dense):
        if (d > 0 and li < len(light)) or di >= len(dense):
            f = light[li]
            li += 1
        else:
            f = dense[di]
            di += 1
        out.append(f)
        d += ex[f]
    return np.asarray(out, dtype=np.int64)


def _heavy_split_order(prob: BalanceProblem, threshold: float, excess: np.ndarray) -> np.ndarray | None:
    """Cut each very heavy sequence where its two ranks cost the same, both filled cheapest-first.

    Heavy: excess above ``threshold`` of a mean rank (at most ``cp - 1`` of them, one per evenly
    spread boundary). The cut is chosen assuming the rest of both ranks is filled with the
    cheapest other sequences (lowest cost per row); those ranks are then filled that way, and
    everything else follows the excess merge. Returns ``None`` when nothing is heavy.
    """
    cp, b, L = prob.cp_size, prob.num_seqs, prob.local_rows
    heavy = _heavy(prob, threshold, excess)
    m = heavy.size
    if m == 0:
        return None
    is_heavy = np.zeros(b, dtype=bool)
    is_heavy[heavy] = True
    rest = np.flatnonzero(~is_heavy)
    density = prob.cost / np.maximum(prob.rows, 1)
    cheap = rest[np.argsort(density[rest], kind="stable")]  # cheapest per row first
    crows = np.cumsum(prob.rows[cheap]).astype(np.float64)
    ccost = np.cumsum(prob.cost[cheap])
    cheap_density = density[cheap]
    hp = prob.rows[heavy][:, None]
    t = np.round(np.linspace(0.0, 1.0, 1025)[None, :] * hp).astype(np.int64)
    t = np.maximum(np.minimum(t, hp - 1), 1)
    head = prob.partial(prob.real[heavy][:, None], t)
    tail = prob.cost[heavy][:, None] - head

    def cost_of_first(k: np.ndarray) -> np.ndarray:  # cost of the k cheapest rows (fractional at the end)
        i = np.minimum(np.searchsorted(crows, k), crows.size - 1)
        prev_rows = np.where(i > 0, crows[np.maximum(i - 1, 0)], 0.0)
        prev_cost = np.where(i > 0, ccost[np.maximum(i - 1, 0)], 0.0)
        return prev_cost + (k - prev_rows) * cheap_density[i]

    def fill(k: np.ndarray, offset: np.ndarray) -> np.ndarray:
        # cost of the k cheapest rows after the first `offset` cheap rows (used by earlier heavies)
        return cost_of_first(np.maximum(k, 0) + offset) - cost_of_first(offset)

    used = np.zeros((m, 1))
    if m > 1:
        used[1:, 0] = np.cumsum(np.maximum(2 * L - hp.ravel()[:-1], 0))
    left = head + fill(L - t, used)
    right = tail + fill(L - (hp - t), used + np.maximum(L - t, 0))
    cut = np.take_along_axis(t, np.maximum(left, right).argmin(1)[:, None], 1).ravel()
    bounds = _spread_bounds(m, cp)

    # reserve the cheapest sequences for the ranks around the cuts; the rest follow the excess merge
    need = float(np.maximum(2 * L - hp.ravel(), 0).sum())
    n_res = int(np.searchsorted(crows, need)) + 1
    reserved = cheap[:n_res].tolist()
    others = cheap[n_res:]
    stream = others[_excess_merge_order_of(prob, others)].tolist() if others.size else []
    rows = prob.rows.tolist()
    out: list[int] = []
    x = ri = si = 0
    for h, c, r in zip(heavy.tolist(), cut.tolist(), bounds.tolist()):
        while x < (r - 1) * L and si < len(stream):
            out.append(stream[si])
            x += rows[stream[si]]
            si += 1
        start = r * L - c
        while x < start and ri < len(reserved):
            f = reserved[ri]
            if x + rows[f] > start and (x + rows[f] - start) > (start - x):
                break  # stopping short is closer to the cut point than overshooting
            out.append(f)
            x += rows[f]
            ri += 1
        out.append(h)
        x += rows[h]
        end = (x // L + 1) * L if x % L else x
        while x < end and ri < len(reserved):
            out.append(reserved[ri])
            x += rows[reserved[ri]]
            ri += 1
    out.extend(stream[si:])
    out.extend(reserved[ri:])
    return np.asarray(out, dtype=np.int64)


def _rank_bins_order(prob: BalanceProblem, giant: float = 0.9, big: float = 0.002, reach: int = 8) -> np.ndarray:
    """Fill the ``cp`` ranks as bins (rows and cost), then concatenate them: for many sequences.

    The filler are the sequences costing at most ``big`` of a mean rank; ``rho`` is their mean
    cost per row. A rank's *room* is its cost budget left once its remaining rows hold filler at
    ``rho`` (``budget - rows_left * rho``); a sequence takes ``cost - rho * rows`` of it.

    * giants (taking over ``giant`` of an empty rank's room, at most ``cp - 1``) straddle evenly
      spread rank boundaries, left to right, cut where their two ranks have the same room left
      (or, when the next boundary cuts a giant too, where the left rank is full);
    * the other non-filler sequences go, most costly first, to the rank with the most room among
      those with rows left for them (greedy, a heap over the ranks);
    * the filler, in an order whose running cost per row stays at ``rho``
      (:func:`_excess_merge_order`), fills each rank's remaining rows;
    * inside a rank the shortest sequences sit at both edges, so the sequences cut by rank
      boundaries (other than giants) are cheap.
    Host NumPy; Python loops over the giants and the non-filler sequences only.
    """
    cp, L = prob.cp_size, prob.local_rows
    rows, cost = prob.rows, prob.cost
    tau = prob.total_cost / cp
    rows_left = np.full(cp, float(L))
    rows_left[-1] -= prob.tail_rows
    budget = np.full(cp, tau)
    budget[-1] -= prob.tail_rows * prob.cost_model.pad_row_cost
    is_filler = cost <= big * tau
    desc = np.flatnonzero(~is_filler)
    desc = desc[_desc(cost[desc])]  # the non-filler, most costly first
    rho = float(cost[is_filler].sum()) / max(float(rows[is_filler].sum()), 1.0)
    takes = cost - rho * rows  # room a sequence takes

    head = np.full(cp, -1, dtype=np.int64)  # giant cut by the boundary after rank b
    empty_room = tau - L * rho
    top = desc[: cp - 1]
    top = top[(takes[top] > giant * empty_room) & (rows[top] > 1) & (rows[top] <= L)]
    for k, i in enumerate(top.tolist()):
        head[int((k + 0.5) * (cp - 1) / top.size)] = i  # distinct, evenly spread boundaries
    for b in np.flatnonzero(head >= 0).tolist():  # left to right: a rank may hold a giant's tail already
        i = int(head[b])
        room_b, room_next = budget[b : b + 2] - rows_left[b : b + 2] * rho
        # the next boundary cuts a giant too: fill this rank (the rest goes right); else both equal
        share = room_b if head[b + 1] >= 0 else (takes[i] + room_b - room_next) / 2
        t, head_cost = _giant_cut(prob, i, rho, share)
        rows_left[b] -= t
        budget[b] -= head_cost
        rows_left[b + 1] -= rows[i] - t
        budget[b + 1] -= cost[i] - head_cost
    placed = np.zeros(rows.shape[0], dtype=bool)
    placed[head[head >= 0]] = True
    # the shortest filler sits next to each giant, ``reach`` sequences on either side: the giant
    # is re-cut among them at the end (the bins only approximate their rows)
    cut_at = np.flatnonzero(head >= 0)
    before_giant: dict[int, np.ndarray] = {}  # by the rank the giant starts on
    after_giant: dict[int, np.ndarray] = {}
    if cut_at.size:
        free = np.flatnonzero(is_filler & ~placed)
        shortest = free[np.argsort(rows[free], kind="stable")[: 2 * reach * cut_at.size]]
        for k, b in enumerate(cut_at.tolist()):
            chunk = shortest[2 * reach * k : 2 * reach * (k + 1)]
            before_giant[b], after_giant[b] = chunk[0::2], chunk[1::2]
            for side, r in ((chunk[0::2], b), (chunk[1::2], b + 1)):
                rows_left[r] -= rows[side].sum()
                budget[r] -= cost[side].sum()
        placed[shortest] = True
    bigs = desc[~placed[desc]]
    bin_of = np.full(rows.shape[0], -1, dtype=np.int64)
    room = [(-float(budget[b] - rows_left[b] * rho), b) for b in range(cp)]  # heap: most room first, then lower rank
    heapq.heapify(room)
    left = rows_left.tolist()
    to: list[int] = []
    big_rows = rows[bigs]
    fewest = np.minimum.accumulate(big_rows[::-1])[::-1].tolist()  # fewest rows of any big still to come
    replace, take = heapq.heapreplace, to.append  # (local names: this loop runs once per sequence)
    for r, x, low in zip(big_rows.tolist(), takes[bigs].tolist(), fewest):
        if room and left[room[0][1]] >= r:
            k, b = room[0]
            replace(room, (k + x, b))
        else:
            b = _take_with_rows(room, left, r, x, low)
        left[b] -= r
        take(b)
    bin_of[bigs] = to
    filler = np.flatnonzero(is_filler & ~placed)
    taken = np.bincount(np.asarray(to, dtype=np.int64), weights=takes[bigs], minlength=cp)
    room_left = budget - rows_left * rho - taken
    needy = np.flatnonzero(room_left < -1e-3 * tau)
    if filler.size and needy.size:
        filler = _cheap_filler_first(prob, filler, needy, room_left, left, bin_of, rho)
    if filler.size:
        filler = filler[_excess_merge_order_of(prob, filler)]
        ends = np.cumsum(np.maximum(left, 0.0))
        mid = np.cumsum(rows[filler]) - rows[filler] / 2
        bin_of[filler] = np.minimum(np.searchsorted(ends, mid, side="right"), cp - 1)
    # concatenate the bins; inside each, shortest at both edges (ties in index order); a giant's
    # near filler sits just before and after it. Every sequence's slot is computed directly.
    members = np.flatnonzero(bin_of >= 0)
    mb = bin_of[members]
    members = members[np.argsort(mb * (int(rows.max()) + 1) + rows[members], kind="stable")]  # by bin, rows, index
    mb = bin_of[members]
    counts = np.bincount(mb, minlength=cp)
    r = np.arange(members.size) - (np.cumsum(counts) - counts)[mb]  # rank inside its bin by rows
    place = np.where(r % 2 == 0, r // 2, counts[mb] - 1 - r // 2)
    lead = np.zeros(cp, dtype=np.int64)  # slots before a bin's members: the filler after the previous giant
    trail = np.zeros(cp, dtype=np.int64)  # slots after them: the filler before its giant, and the giant
    for b in cut_at.tolist():
        trail[b] = before_giant[b].size + 1
        lead[b + 1] = after_giant[b].size
    start = np.cumsum(lead + counts + trail) - (lead + counts + trail)
    order = np.empty(members.size + int((lead + trail).sum()), dtype=np.int64)
    order[start[mb] + lead[mb] + place] = members
    giant_slot = []
    for b in cut_at.tolist():
        before, after = before_giant[b], after_giant[b]
        at = start[b] + lead[b] + counts[b]
        order[at : at + before.size] = before
        order[at + before.size] = head[b]
        giant_slot.append(at + before.size)
        order[start[b + 1] : start[b + 1] + after.size] = after
    if not cut_at.size:
        return order
    return _slide_giants(prob, order, cut_at, np.asarray(giant_slot, dtype=np.int64), reach)


def _giant_cut(prob: BalanceProblem, i: int, rho: float, share: float) -> tuple[int, float]:
    """Rows ``t`` (``1 <= t < rows``) of giant ``i`` on the left rank, and their cost ``F(t)``, so
    that its head takes ``share`` of the left rank's room (room: cost beyond filler at ``rho``):
    ``h(t) = F(t) - rho t - share = 0``. ``h`` is convex (the per-row cost does not fall with
    position) and starts at ``-share``, so where ``0 < share < takes`` it crosses 0 once and
    ``|h|`` is least next to the crossing (else at an end): found on a coarse grid, then row by
    row inside one grid step."""
    p, real = int(prob.rows[i]), prob.real[i : i + 1]
    grid = 1 + np.arange(65) * (p - 2) // 64  # 1 .. p - 1, non-decreasing
    h = prob.partial(real, grid) - rho * grid - share
    k = int(np.searchsorted(h >= 0, True)) if bool((h >= 0).any()) else grid.size - 1  # first grid point past 0
    t = np.arange(grid[max(k - 1, 0)], grid[k] + 1, dtype=np.int64)
    head_cost = prob.partial(real, t)
    best = int(np.argmin(np.abs(head_cost - rho * t - share)))
    return int(t[best]), float(head_cost[best])


def _cheap_filler_first(prob, filler, needy, room_left, left, bin_of, rho) -> np.ndarray:
    """Give each rank with negative room (over budget even with filler at ``rho``: typically next
    to a giant) the cheapest filler per row: until its deficit is covered, or, when the filler
    cheaper than ``rho`` cannot cover it, all its rows. Returns the filler not taken; ``left``
    and ``bin_of`` are updated in place."""
    rows, cost = prob.rows, prob.cost
    cheap = filler[np.argsort(cost[filler] / np.maximum(rows[filler], 1), kind="stable")]
    gain = np.cumsum(rho * rows[cheap] - cost[cheap])  # room freed; increases while below rho
    cum_rows = np.cumsum(rows[cheap])
    below = int((cost[cheap] < rho * rows[cheap]).sum())  # the cheaper-than-rho ones come first
    pos, n = 0, cheap.size
    for b in needy.tolist():
        if pos >= n:
            break
        g0 = gain[pos - 1] if pos else 0.0
        r0 = cum_rows[pos - 1] if pos else 0
        fits = pos + int(np.searchsorted(cum_rows[pos:] - r0, left[b], side="right"))
        if pos < below and gain[below - 1] - g0 >= -room_left[b]:
            fits = min(fits, pos + int(np.searchsorted(gain[pos:below] - g0, -room_left[b], side="left")) + 1)
        bin_of[cheap[pos:fits]] = b
        left[b] -= int(rows[cheap[pos:fits]].sum())
        pos = fits
    return cheap[pos:]


def _slide_giants(prob: BalanceProblem, order: np.ndarray, bounds: np.ndarray, slot: np.ndarray, reach: int):
    """Re-cut each giant (at ``slot[k]``, cut by the boundary after rank ``bounds[k]``) by choosing
    which of its ``2 reach`` neighbours stand before it: the larger of its two ranks' costs is
    made smallest.

    A giant's cut point decides how its large cost splits between two ranks, and the bins only
    approximate their planned rows. Putting a set ``S`` of the neighbours before the giant gives
    it ``t = boundary - window start - rows(S)`` rows on the left rank: the left rank costs its
    fixed part + ``cost(S) + F(t)``, the right one the rest. Tried: the giant at every place in
    the window (a prefix of the neighbours before it), and each such prefix with its last
    neighbour swapped for any later one or any of it swapped for the next one (steps finer than
    the neighbours' own lengths). Nothing outside the window changes while the window stays
    inside the two ranks. Giants are done last first (earlier slots keep their rows; windows must
    not overlap), and a change updates its two ranks' costs (adjacent giants share a rank).
    """
    n, L = prob.num_seqs, prob.local_rows
    cum_rows = np.concatenate([[0], np.cumsum(prob.rows[order])])
    cum_cost = np.concatenate([[0.0], np.cumsum(prob.cost[order])])
    rank = np.diff(_cum_cost_at(prob, order, cum_rows, cum_cost, np.arange(prob.cp_size + 1) * L)).tolist()
    window_end = n  # a window must end where the window processed before it begins
    for k in np.argsort(-slot, kind="stable").tolist():  # last giant first: earlier slots keep their rows
        s, g, b = int(slot[k]), int(order[slot[k]]), int(bounds[k])
        lo, hi = max(s - reach, 0), min(s + reach + 1, n)
        p, t_now = int(prob.rows[g]), int((b + 1) * L - cum_rows[s])  # giant rows on the left rank
        if not 0 < t_now < p or cum_rows[lo] < b * L or cum_rows[hi] > (b + 2) * L or hi > window_end:
            continue  # not cut by its boundary, or the window reaches a third rank or another window
        window_end = lo
        window = np.concatenate([order[lo:s], order[s + 1 : hi]])
        w_rows, w_cost = prob.rows[window], prob.cost[window]
        m, before = window.size, s - lo
        # S = the first j neighbours (j = 0..m; j = before: as it stands); or that with its last
        # one (a = j - 1) swapped for any later one (c >= j), or any of it swapped for the next one
        j, a, c = _slide_family(m)
        swap = a >= 0
        pre_rows = np.concatenate([[0], np.cumsum(w_rows)])
        pre_cost = np.concatenate([[0.0], np.cumsum(w_cost)])
        s_rows = pre_rows[j] + np.where(swap, w_rows[c] - w_rows[a], 0)
        s_cost = pre_cost[j] + np.where(swap, w_cost[c] - w_cost[a], 0.0)
        t = (b + 1) * L - int(cum_rows[lo]) - s_rows
        f = prob.partial(prob.real[g : g + 1], np.minimum(np.maximum(t, 0), p))  # F(t): the giant's head
        f_now = float(f[before])  # the no-swap entries come first, one per j
        left, right = rank[b], rank[b + 1]
        fixed_left = left - float(pre_cost[before]) - f_now
        fixed_right = right - float(pre_cost[-1] - pre_cost[before]) - (float(prob.cost[g]) - f_now)
        lhs = fixed_left + s_cost + f
        rhs = fixed_right + (pre_cost[-1] - s_cost) + (float(prob.cost[g]) - f)
        worse = np.where((t > 0) & (t < p), np.maximum(lhs, rhs), np.inf)
        best = int(worse.argmin())
        if worse[best] < max(left, right) * (1 - _REL_TOL):
            in_s = np.arange(m) < j[best]
            if swap[best]:
                in_s[a[best]], in_s[c[best]] = False, True
            order = order.copy()
            order[lo:hi] = np.concatenate([window[in_s], [g], window[~in_s]])
            rank[b], rank[b + 1] = float(lhs[best]), float(rhs[best])  # adjacent giants share a rank
    return order


@functools.lru_cache(maxsize=None)
def _slide_family(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(j, a, c) of :func:`_slide_giants`' candidates for ``m`` neighbours (``a = c = -1``: no swap)."""
    jj, cc = np.meshgrid(np.arange(m + 1), np.arange(m), indexing="ij")
    last_out = (jj >= 1) & (cc >= jj)  # a = j - 1 swapped for c >= j
    jb, ab = np.meshgrid(np.arange(m + 1), np.arange(m), indexing="ij")
    next_in = (jb < m) & (ab < jb) & (ab != jb - 1)  # a < j - 1 swapped for c = j (a = j - 1: above)
    none = -np.ones(m + 1, dtype=np.int64)
    j = np.concatenate([np.arange(m + 1), jj[last_out], jb[next_in]])
    a = np.concatenate([none, jj[last_out] - 1, ab[next_in]])
    c = np.concatenate([none, cc[last_out], jb[next_in]])
    for arr in (j, a, c):
        arr.setflags(write=False)
    return j, a, c


def _cum_cost_at(prob: BalanceProblem, order: np.ndarray, cum_rows, cum_cost, x: np.ndarray) -> np.ndarray:
    """Cost of buffer rows ``[0, x)`` for one order (``cum_rows``/``cum_cost``: its prefix sums)."""
    n = order.size
    idx = np.searchsorted(cum_rows, x, side="right") - 1
    off = x - cum_rows[idx]
    inside = cum_cost[np.minimum(idx, n)] + prob.partial(prob.real[order[np.minimum(idx, n - 1)]], off)
    return np.where(idx >= n, cum_cost[n] + prob.cost_model.pad_row_cost * off, inside)


def _take_with_rows(room: list, left: list, r: int, x: float, low: int) -> int:
    """The rank with the most room among those in the heap ``room`` (of ``(-room, rank)``) with
    ``r`` rows left, else the one with the most rows left; its room shrinks by ``x``. The heap is
    rebuilt from the ranks that can still take a later sequence (``low``: the fewest rows of any)."""
    fit = [e for e in room if left[e[1]] >= r]
    if fit:
        k, b = min(fit)
    else:
        b = max(range(len(left)), key=left.__getitem__)
        k = next((e[0] for e in room if e[1] == b), 0.0)
    rest = [e for e in room if e[1] != b and left[e[1]] >= low]
    room[:] = rest + ([(k + x, b)] if left[b] - r >= low else [])
    heapq.heapify(room)
    return b


def _cheap_candidates(prob: BalanceProblem, excess: np.ndarray) -> list[np.ndarray]:
    """Plain order and the excess merge; for small batches also longest-first, snake and shortest-first."""
    b = prob.num_seqs
    cands = [np.arange(b), _excess_merge_order(excess)]
    if b <= _SMALL:  # cheap extra starting points where the local search is cheap too
        longest = _desc(prob.rows)
        cands += [longest, _snake_order(prob), longest[::-1].copy()]
    return cands


def _heavy_candidates(prob: BalanceProblem, excess: np.ndarray) -> list[np.ndarray]:
    """Orders that cut heavy sequences at rank boundaries (Python loops over the sequences)."""
    cands = []
    top = float(excess.max()) / (prob.total_cost / prob.cp_size)
    for threshold in (0.25, 0.05):
        if top > threshold:  # some sequence is heavy
            walk = _heavy_walk_order(prob, threshold, excess)
            if walk is not None:
                cands.append(walk)
    if top > 0.5:
        split = _heavy_split_order(prob, 0.5, excess)
        if split is not None:
            cands.append(split)
    return cands


# ----------------------------------------------------------------------------------------------
# local search with incremental evaluation
#
# A swap of slots i < j, or moving the sequence at slot i to slot j, changes the buffer only
# between the two slots: one range of untouched sequences shifts by a row / cost delta and one or
# two sequences are placed at new starts. The cumulative cost at each rank boundary is then found
# with one binary search in the *current* cumulative arrays, so a candidate costs O(cp) instead
# of O(B): thousands of candidates per round for 1024 sequences.


class _Current:
    """Cumulative rows / cost of one order, with the tail padding as an extra, fixed slot."""

    def __init__(self, prob: BalanceProblem, order: np.ndarray):
        self.order = order
        self.rows = np.append(prob.rows[order], prob.tail_rows)
        self.cost = np.append(prob.cost[order], prob.tail_rows * prob.cost_model.pad_row_cost)
        self.real = np.append(prob.real[order], 0)
        self.cum_rows = np.concatenate([[0], np.cumsum(self.rows)])
        self.cum_cost = np.concatenate([[0.0], np.cumsum(self.cost)])


def _eval_moves(prob: BalanceProblem, cur: _Current, i: np.ndarray, j: np.ndarray, swap: np.ndarray) -> np.ndarray:
    """Per-rank costs ``[K, cp]`` after swapping (``swap``) or moving slot ``i`` to slot ``j``."""
    b = prob.num_seqs
    cr, cc, rows, cost = cur.cum_rows, cur.cum_cost, cur.rows, cur.cost
    x = prob.bounds[None, :]
    lo, hi = np.minimum(i, j), np.maximum(i, j)
    fwd = i < j
    back = swap | ~fwd
    # item 1: swap -> the sequence of slot hi placed at slot lo; move -> the moved sequence (slot i)
    s1 = np.where(swap, hi, i)
    start1 = np.where(back, cr[lo], cr[j + 1] - rows[i])
    ccs1 = np.where(back, cc[lo], cc[j + 1] - cost[i])
    # shifted range [a, e) of untouched slots
    d_rows = np.where(swap, rows[hi] - rows[lo], np.where(fwd, -rows[i], rows[i]))
    d_cost = np.where(swap, cost[hi] - cost[lo], np.where(fwd, -cost[i], cost[i]))
    a = np.where(swap | fwd, lo + 1, lo)
    e = np.where(swap, hi, np.where(fwd, hi + 1, hi))
    # item 2 (swaps only): the sequence of slot lo placed at slot hi
    start2 = (cr[hi] + d_rows)[:, None]
    ccs2 = (cc[hi] + d_cost)[:, None]
    s1, start1, ccs1, lo2 = s1[:, None], start1[:, None], ccs1[:, None], lo[:, None]
    d_rows, d_cost, a, e = d_rows[:, None], d_cost[:, None], a[:, None], e[:, None]

    base_slot = np.minimum(np.searchsorted(cr, prob.bounds, side="right") - 1, b)[None, :]
    y = x - d_rows
    y_slot = np.clip(np.searchsorted(cr, y, side="right") - 1, 0, b)
    in_shift = (y_slot >= a) & (y_slot < e) & (y >= 0)
    off1 = x - start1
    in1 = (off1 >= 0) & (off1 < rows[s1])
    off2 = x - start2
    in2 = swap[:, None] & (off2 >= 0) & (off2 < rows[lo2])

    slot = np.where(in1, s1, np.where(in2, lo2, np.where(in_shift, y_slot, base_slot)))
    off = np.where(in1, off1, np.where(in2, off2, np.where(in_shift, y - cr[y_slot], x - cr[base_slot])))
    ccs = np.where(in1, ccs1, np.where(in2, ccs2, np.where(in_shift, cc[y_slot] + d_cost, cc[base_slot])))
    return _rank_diff(ccs + prob.partial(cur.real[slot], off), prob.total_cost)


def _apply_move(order: np.ndarray, i: int, j: int, swap: bool) -> np.ndarray:
    out = order.copy()
    if swap:
        out[i], out[j] = order[j], order[i]
    elif i < j:
        out[i:j] = order[i + 1 : j + 1]
        out[j] = order[i]
    else:
        out[j + 1 : i + 1] = order[j:i]
        out[j] = order[i]
    return out


def _spread(lo: int, hi: int, count: int) -> np.ndarray:
    """Up to ``count`` evenly spread integers in ``[lo, hi]`` (all of them when few)."""
    if hi - lo + 1 <= count:
        return np.arange(lo, hi + 1)
    return np.unique(np.round(np.linspace(lo, hi, count)).astype(np.int64))


def _neighbourhood(prob: BalanceProblem, cur: _Current, costs: np.ndarray, max_moves: int):
    """(i, j, swap) of candidate moves around the most loaded rank.

    Sources: the slots touching the most loaded rank (its two straddlers and its most costly
    sequences always, the rest spread evenly). Targets: the slots next to every rank boundary
    (where a move changes which sequence straddles and where it is cut) plus slots spread over
    the whole buffer. Each (source, target) pair is tried as a swap and as a move either way.
    """
    b = prob.num_seqs
    first, last = prob._boundary_slots(cur.order, cur.cum_rows)
    worst = int(costs.argmax())
    f, l = int(first[worst]), int(last[worst])
    n_src = max(4, int(math.sqrt(max_moves / 3)))
    heavy = f + _desc(cur.cost[f : l + 1])[: max(1, n_src // 3)]
    src = np.unique(np.concatenate([[f, l], heavy, _spread(f, l, n_src)]))
    n_dst = max(4, max_moves // (3 * src.size))
    near = np.clip((first[1:, None] + np.arange(-1, 2)[None, :]).ravel(), 0, b - 1)[: n_dst // 2]
    dst = np.unique(np.concatenate([near, _spread(0, b - 1, max(2, n_dst - near.size))]))
    ii = np.repeat(src, dst.size)
    jj = np.tile(dst, src.size)
    keep = ii != jj
    ii, jj = ii[keep], jj[keep]
    n = ii.size
    swap = np.zeros(3 * n, dtype=bool)
    swap[:n] = True
    i_all, j_all = np.concatenate([ii, ii, jj]), np.concatenate([jj, jj, ii])
    # a heavy sequence on the worst rank (over a quarter of a mean rank) in a small batch: try
    # every slot for it, i.e. every boundary and every cut point the other sequences allow (in
    # large batches the rank-bins start places such sequences and tunes their cut)
    top = int(heavy[0])
    if b <= _SMALL and float(cur.cost[top]) > 0.25 * prob.total_cost / prob.cp_size:
        j = np.delete(np.arange(b), top)
        i_all = np.concatenate([i_all, np.full_like(j, top)])
        j_all = np.concatenate([j_all, j])
        swap = np.concatenate([swap, np.zeros(j.size, dtype=bool)])
    return i_all, j_all, swap


def _local_search(
    prob: BalanceProblem, order: np.ndarray, costs: np.ndarray, rounds: int, max_moves: int, good_enough: float
):
    mean = prob.total_cost / prob.cp_size
    for _ in range(rounds):
        if float(costs.max()) <= mean * good_enough:
            break
        cur = _Current(prob, order)
        i, j, swap = _neighbourhood(prob, cur, costs, max_moves)
        if i.size == 0:
            break
        cand_costs = _eval_moves(prob, cur, i, j, swap)
        k = _pick_best(cand_costs)
        if not _better(cand_costs[k], costs):
            break
        order = _apply_move(order, int(i[k]), int(j[k]), bool(swap[k]))
        costs = cand_costs[k]
    return order, costs


def _exhaustive(prob: BalanceProblem) -> np.ndarray:
    perms = np.asarray(list(itertools.permutations(range(prob.num_seqs))), dtype=np.int64)
    # identity is perms[0]: ties keep the plain order
    return perms[_pick_best(prob.costs_np(perms))]


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
    max_moves: int | None = None,
    good_enough: float = _GOOD_ENOUGH,
    kicks: int | None = None,
    exhaustive_max: int = _EXHAUSTIVE_MAX,
) -> torch.Tensor:
    """Return the permutation ``order`` (int64 ``[B]``) minimising the largest per-rank cost.

    Buffer position ``k`` holds sequence ``order[k]``. ``problem`` may be given instead of the
    padding options (it carries padded lengths, e.g. taken from a layout plan). ``rounds`` bounds
    the local-search rounds (default: none above 256 sequences, where the constructions alone
    keep planning under a millisecond; 4 to 48 for smaller batches);
    ``max_moves`` bounds the candidate moves evaluated per round; the search stops early once the
    straggler ratio is at most ``good_enough``; ``kicks`` random restarts from perturbed copies of
    the best order follow (default: ``min(32, 512 // B)`` for at most 64 sequences, none above);
    batches of at most ``exhaustive_max`` sequences are solved exactly.
    """
    prob = problem or BalanceProblem.contiguous(
        seqlens,
        cp_size=cp_size,
        cost_model=cost_model,
        tp_size=tp_size,
        min_local_rows=min_local_rows,
        pad_to_length_bucket=pad_to_length_bucket,
    )
    return torch.from_numpy(_balance(prob, rounds, max_moves, good_enough, kicks, exhaustive_max))


def _balance(prob: BalanceProblem, rounds, max_moves, good_enough: float, kicks, exhaustive_max: int) -> np.ndarray:
    """:func:`balance_order` on the host (the module docstring's algorithm); ``None`` picks a default."""
    b = prob.num_seqs
    if prob.cp_size == 1 or b == 1 or prob.total_cost <= 0:  # nothing to balance (e.g. only empty sequences)
        return np.arange(b)
    if b <= exhaustive_max:
        return _exhaustive(prob)
    mean = prob.total_cost / prob.cp_size
    excess = _excess(prob)
    many = b >= 4 * prob.cp_size
    # The excess merge cuts rank boundaries within about half the excess of the sequences that
    # land there; with a sequence whose excess is over _BINS_FIRST of a mean rank it rarely gets
    # within good_enough, and the rank bins (which cut large sequences on purpose) go first.
    top = float(excess.max())
    bins_first = many and top > _BINS_FIRST * mean
    if bins_first:
        cands = np.stack([np.arange(b), _rank_bins_order(prob)])
    else:
        cands = np.stack(_cheap_candidates(prob, excess))
    cand_costs = prob.costs_np(cands)

    def add(more: list[np.ndarray]) -> float:
        nonlocal cands, cand_costs
        if more:
            more = np.stack(more)
            cands = np.concatenate([cands, more])
            cand_costs = np.concatenate([cand_costs, prob.costs_np(more)])
        return float(cand_costs.max(1).min())

    best = float(cand_costs.max(1).min())
    if many and best > mean * good_enough:  # the other construction (the merge: unless hopeless)
        if not bins_first:
            best = add([_rank_bins_order(prob)])
        elif top <= 0.25 * mean:
            best = add(_cheap_candidates(prob, excess)[1:])
    # Large batches stop here (the heavy constructions and the local search cost milliseconds at
    # 1024 sequences) unless a sequence spans more than a rank: the rank bins cannot place those,
    # and the batch holds a long sequence anyway, which dwarfs a few milliseconds of planning.
    spans = int(prob.rows.max()) > prob.local_rows
    search = b <= _SMALL or (spans and best > mean * good_enough)
    if search:
        add(_heavy_candidates(prob, excess))
    if rounds is None:
        rounds = max(4, min(48, 4096 // b)) if search else 0
    if max_moves is None:
        max_moves = max(192, min(3072, (1 << 17) // b))
    if kicks is None:
        kicks = 0 if b > 64 else min(32, 512 // b)
    # local search from the two best starting points (a better start can end in a worse optimum)
    k = _pick_best(cand_costs)
    order, costs = _local_search(prob, cands[k], cand_costs[k], rounds, max_moves, good_enough)
    if search and cands.shape[0] > 1 and float(costs.max()) > mean * good_enough:
        rest = np.delete(np.arange(cands.shape[0]), k)
        k2 = int(rest[_pick_best(cand_costs[rest])])
        order2, costs2 = _local_search(prob, cands[k2], cand_costs[k2], rounds, max_moves, good_enough)
        if _better(costs2, costs):
            order, costs = order2, costs2
    # iterated local search: perturb the best order with two random moves, search again, keep
    # the result if it is better. The generator is seeded, so every rank gets the same answer.
    rng = np.random.Generator(np.random.PCG64(0x5EED)) if kicks else None
    for _ in range(kicks):
        if float(costs.max()) <= mean * good_enough:
            break
        kicked = order
        for _ in range(2):
            i, j = rng.integers(0, b, 2).tolist()
            if i != j:
                kicked = _apply_move(kicked, i, j, swap=bool(rng.random() < 0.5))
        kicked_costs = prob.costs_np(kicked[None, :])[0]
        kicked, kicked_costs = _local_search(prob, kicked, kicked_costs, min(rounds, 16), max_moves, good_enough)
        if _better(kicked_costs, costs):
            order, costs = kicked, kicked_costs
    return order


def balanced_host_order(
    host_seqlens: np.ndarray, options: PlanOptions, cost_model: str | TokenCostModel | None = None
) -> np.ndarray:
    """The order ``build_plan`` uses when ``options.balance`` is set (int64 NumPy ``[B]``), from
    the host lengths of its one device-to-host transfer (int64, ``>= 0``). ``cost_model``
    defaults to ``options.balance``."""
    model = cost_model or getattr(options, "balance", None) or "ds4"
    prob = BalanceProblem.from_host(np.asarray(host_seqlens, dtype=np.int64), options, model)
    return _balance(prob, None, None, _GOOD_ENOUGH, None, _EXHAUSTIVE_MAX)


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


def _cheapest_fill(prob: BalanceProblem):
    """``fill(k)``: a lower bound on the cost of any ``k`` buffer rows.

    Row cost depends only on the position inside a sequence and grows with it, so the ``k``
    cheapest rows of the batch are the padding rows (at ``min(pad_row_cost, c(0))``) and then
    all rows at position 0, all at position 1, ... (``m(p)`` sequences are longer than ``p``).
    """
    cm = prob.cost_model
    n_sorted = torch.sort(prob.seqlens).values
    p = torch.arange(int(n_sorted[-1]) if n_sorted.numel() else 0, dtype=torch.int64)
    m = prob.num_seqs - torch.searchsorted(n_sorted, p, right=True)  # sequences longer than p
    c = cm.token_cost(p)
    pad_rows = prob.total_rows - int(prob.seqlens.sum())
    pad_cost = min(cm.pad_row_cost, float(cm.token_cost(torch.zeros(1))[0]))
    cnt = torch.cat([torch.tensor([0, pad_rows]), pad_rows + m.cumsum(0)])
    cost = torch.cat([torch.tensor([0.0, pad_rows * pad_cost], dtype=torch.float64), pad_rows * pad_cost + (m * c).cumsum(0)])
    unit = torch.cat([torch.tensor([pad_cost], dtype=torch.float64), c])  # cost of one row in each bucket

    def fill(k: torch.Tensor) -> torch.Tensor:
        k = k.clamp(min=0)
        q = (torch.searchsorted(cnt, k, right=True) - 1).clamp(0, unit.numel() - 1)
        return cost[q] + (k - cnt[q]).to(torch.float64) * unit[q]

    return fill


def straggler_lower_bound(prob: BalanceProblem, top: int = 32) -> float:
    """A lower bound on the straggler ratio of *any* order (tells unreachable targets apart).

    Wherever a sequence of ``n`` real tokens is placed, rank boundaries cut it into pieces: a
    first piece of ``l0`` tokens (``1 <= l0 <= min(n, L)``), then pieces of ``L`` tokens, then the
    rest. The rank holding a piece ``[s, e)`` costs at least ``F(e) - F(s)`` plus the cheapest
    possible ``L - (e - s)`` other rows (:func:`_cheapest_fill`). The bound is, over the ``top``
    most costly sequences, the smallest over ``l0`` of the largest piece bound, divided by the mean
    rank cost (and at least 1). Alignment padding is relaxed, so the bound may be loose.
    """
    cm = prob.cost_model
    L = prob.local_rows
    mean = prob.total_cost / prob.cp_size
    fill = _cheapest_fill(prob)
    best = 1.0
    heavy = torch.argsort(prob.seq_cost, descending=True)[:top]
    for n in torch.unique(prob.seqlens[heavy]).tolist():
        if n == 0:
            continue
        l0 = torch.arange(1, min(n, L) + 1, dtype=torch.int64).view(-1, 1)
        pieces = (n - 1) // L + 2
        ends = (l0 + L * torch.arange(pieces, dtype=torch.int64).view(1, -1)).clamp(max=n)
        starts = torch.cat([torch.zeros_like(l0), ends[:, :-1]], 1)
        length = ends - starts
        piece = cm.prefix_cost(ends) - cm.prefix_cost(starts) + fill(L - length)
        piece = torch.where(length > 0, piece, torch.zeros_like(piece))
        best = max(best, float(piece.max(1).values.min()) / mean)
    return best
