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
    unseeded randomness, stable sorts, float64 host arithmetic on tensors small enough to be
    reduced on one thread), because every CP rank computes the plan on its own and all must
    agree. Ranks are assumed to run the same torch build on the same kind of CPU.
  * Never worse than the plain order under the chosen cost model: the identity order is always
    a candidate and a move is only accepted when it lowers the objective.

Cost of a rank: each of its rows costs ``c(position inside its sequence)``; padding rows cost
``pad_row_cost``. A sequence straddling a boundary therefore splits its cost by position (its
cheap head on the left rank, its expensive tail on the right one). Costs are evaluated with
closed-form prefix sums at the ``cp - 1`` boundaries only, batched over candidate orders.

Algorithm (vectorised, except the heavy-sequence constructions, which loop over sequences in
Python and run only when some sequence costs over a quarter of a mean rank, and the rank-bins
start, which loops over the costly sequences when the cheap candidates are not good enough):
  1. candidates: plain order; an "excess merge" that interleaves sequences whose cost per row is
     above the buffer mean with those below it so the cumulative cost tracks the straight line
     from 0 to the total (boundaries then cut near ``r * mean``); longest-first; and a snake
     partition by cost. The best is kept.
  1b. many sequences (``B >= 4 cp``) and no candidate within 1% of the mean yet: "rank bins"
     (:func:`_rank_bins_order`): giants straddle boundaries, the other costly sequences are
     dealt to the ranks with the most budget left after reserving their share of the short
     ones, and the short ones fill the remaining rows (dense attention with heavy-tailed
     lengths: the SFT case at CP 16).
  2. heavy sequences (far above the mean cost per row) are cut at rank boundaries: half-way
     through their excess with a balancing walk of the others around them, or where their two
     ranks cost the same with the cheapest other sequences reserved for those ranks.
  3. local search: best-improvement over swap and move (remove + insert) neighbourhoods around
     the most loaded rank, objective (max rank cost, then sum of squares), each candidate
     evaluated incrementally in O(cp).
  4. small batches: seeded restarts from perturbed copies of the best order (iterated local
     search); tiny batches (``B <= exhaustive_max``): all ``B!`` orders are evaluated (optimal).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .cost import TokenCostModel, get_cost_model
from .plan import PlanOptions
from .types import CPLayout

__all__ = [
    "BalanceProblem",
    "balance_order",
    "balanced_order_for_plan",
    "rank_costs",
    "straggler_ratio",
    "straggler_lower_bound",
]

_REL_TOL = 1e-12
_BINS_BELOW = 1.01  # a straggler ratio the cheap candidates already reach: skip the rank-bins start


def _as_lengths(seqlens) -> torch.Tensor:
    t = torch.as_tensor(seqlens)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"seqlens must be a non-empty 1-D tensor of sequence lengths, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"seqlens must be integers, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if bool((t < 0).any()):
        raise ValueError(f"sequence lengths must be non-negative, got a minimum of {int(t.min())}")
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
    def from_options(
        cls, seqlens, options: PlanOptions, cost_model: str | TokenCostModel = "ds4"
    ) -> "BalanceProblem":
        """The problem of a contiguous plan: padding follows ``options`` exactly as ``build_plan`` does."""
        lens = _as_lengths(seqlens).cpu()
        if options.layout is not CPLayout.CONTIGUOUS:
            raise ValueError(
                f"sequence-order balancing needs the contiguous layout, got layout='{options.layout}'. "
                "Zigzag already balances dense causal attention inside every sequence."
            )
        unit = options.sequence_alignment
        padded = lens + (-lens) % unit
        total = options.padded_total(int(padded.sum()))
        return cls(lens, padded, total, options.cp_size, get_cost_model(cost_model))

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


def _excess_merge_order_of(prob: BalanceProblem, ids: torch.Tensor, excess: torch.Tensor) -> torch.Tensor:
    """:func:`_excess_merge_order` of the subset ``ids`` (positions into ``ids``), around its own mean."""
    rows = prob.padded[ids].to(torch.float64)
    sub = prob.seq_cost[ids]
    sub_excess = sub - float(sub.sum()) / max(float(rows.sum()), 1.0) * rows
    return _excess_merge_order(prob, sub_excess)


def _excess_merge_order(prob: BalanceProblem, excess: torch.Tensor) -> torch.Tensor:
    """Interleave above-mean and below-mean sequences so cumulative cost tracks the mean line."""
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
    return srt[torch.argsort(key, stable=True)]


def _excess(prob: BalanceProblem) -> torch.Tensor:
    """Per-sequence cost above the mean row cost times its rows (negative: cheaper than average)."""
    return prob.seq_cost - (prob.total_cost / prob.total_rows) * prob.padded.to(torch.float64)


def _heavy_walk_order(prob: BalanceProblem, threshold: float, excess: torch.Tensor) -> torch.Tensor | None:
    """Cut heavy sequences at rank boundaries, and fill around them with a balancing walk.

    A sequence is heavy when its excess (cost above the mean row cost times its rows) is more
    than ``threshold`` of a mean rank. Up to ``cp - 1`` heavy sequences are assigned to distinct,
    evenly spread boundaries and placed so the boundary cuts each where half its excess is on
    either side. The other sequences follow a walk that keeps the cumulative deviation from the
    mean line at its target: a below-mean sequence next when ahead, an above-mean one when
    behind; the target is ``-excess/2`` just before a heavy sequence and 0 elsewhere.
    Returns ``None`` when nothing is heavy. Python loop over sequences: used for small batches
    and when heavy sequences exist.
    """
    cp, b, L = prob.cp_size, prob.num_seqs, prob.local_rows
    tau = prob.total_cost / cp
    mean_row = prob.total_cost / prob.total_rows
    heavy = torch.argsort(excess, descending=True, stable=True)[: cp - 1]
    heavy = heavy[excess[heavy] > threshold * tau]
    m = heavy.numel()
    if m == 0:
        return None
    # where half of each heavy sequence's excess is reached (grid search, one batched call)
    grid = torch.linspace(0, 1, 1025, dtype=torch.float64).view(1, -1)
    hp = prob.padded[heavy].view(-1, 1)
    t = (grid * hp).round().to(torch.int64)
    real = torch.minimum(t, prob.seqlens[heavy].view(-1, 1))
    dev = prob.cost_model.prefix_cost(real) + prob.cost_model.pad_row_cost * (t - real) - mean_row * t
    half = excess[heavy].view(-1, 1) / 2
    cut = t.gather(1, (dev - half).abs().argmin(1, keepdim=True)).flatten().clamp(1, None)
    cut = torch.minimum(cut, hp.flatten() - 1).clamp(min=1)
    bounds = ((torch.arange(m, dtype=torch.float64) + 0.5) * (cp - 1) / m).floor().to(torch.int64) + 1

    rows, cost, ex = prob.padded.tolist(), prob.seq_cost.tolist(), excess.tolist()
    is_heavy = torch.zeros(b, dtype=torch.bool)
    is_heavy[heavy] = True
    rest = (~is_heavy).nonzero().flatten()
    light = rest[excess[rest] < 0]
    light = light[torch.argsort(excess[light], stable=True)].tolist()  # most negative first
    dense = rest[excess[rest] >= 0]
    dense = dense[torch.argsort(excess[dense], descending=True, stable=True)].tolist()
    plan = list(zip(heavy.tolist(), cut.tolist(), bounds.tolist(), excess[heavy].tolist()))
    out: list[int] = []
    x, d = 0, 0.0  # rows placed, cumulative deviation from the mean line
    li = di = 0
    for h, c, r, e in plan:
        start = r * L - c  # where h must start so boundary r cuts it after c rows
        if start < x:  # an earlier heavy sequence already covers this boundary: place h next
            start = x
        target = -e / 2
        while x < start:
            want_light = d > target
            if (want_light and li < len(light)) or di >= len(dense):
                if li >= len(light):
                    break
                f = light[li]
            else:
                f = dense[di]
            if x + rows[f] > start and (x + rows[f] - start) > (start - x):
                break  # placing f would overshoot the cut point more than stopping here
            out.append(f)
            x += rows[f]
            d += ex[f]
            if f == (light[li] if li < len(light) else -1):
                li += 1
            else:
                di += 1
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
    return torch.tensor(out, dtype=torch.int64)


def _heavy_split_order(prob: BalanceProblem, threshold: float, excess: torch.Tensor) -> torch.Tensor | None:
    """Cut each very heavy sequence where its two ranks cost the same, both filled cheapest-first.

    Heavy: excess above ``threshold`` of a mean rank (at most ``cp - 1`` of them, one per evenly
    spread boundary). The cut is chosen assuming the rest of both ranks is filled with the
    cheapest other sequences (lowest cost per row); those ranks are then filled that way, and
    everything else is placed by the mean-line walk of :func:`_heavy_walk_order`'s fillers.
    Returns ``None`` when nothing is heavy.
    """
    cp, b, L = prob.cp_size, prob.num_seqs, prob.local_rows
    tau = prob.total_cost / cp
    heavy = torch.argsort(excess, descending=True, stable=True)[: cp - 1]
    heavy = heavy[excess[heavy] > threshold * tau]
    m = heavy.numel()
    if m == 0:
        return None
    is_heavy = torch.zeros(b, dtype=torch.bool)
    is_heavy[heavy] = True
    rest = (~is_heavy).nonzero().flatten()
    density = prob.seq_cost / prob.padded.clamp(min=1).to(torch.float64)
    cheap = rest[torch.argsort(density[rest], stable=True)]  # cheapest per row first
    crows = prob.padded[cheap].cumsum(0).to(torch.float64)
    ccost = prob.seq_cost[cheap].cumsum(0)
    hp = prob.padded[heavy].view(-1, 1)
    t = (torch.linspace(0, 1, 1025, dtype=torch.float64).view(1, -1) * hp).round().to(torch.int64)
    t = torch.minimum(t, hp - 1).clamp(min=1)
    real = torch.minimum(t, prob.seqlens[heavy].view(-1, 1))
    head = prob.cost_model.prefix_cost(real) + prob.cost_model.pad_row_cost * (t - real)
    tail = prob.seq_cost[heavy].view(-1, 1) - head

    def fill(k: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        # cost of the k cheapest rows after the first `offset` cheap rows (used by earlier heavies)
        k = k.clamp(min=0).to(torch.float64) + offset
        i = torch.searchsorted(crows, k).clamp(max=crows.numel() - 1)
        pr = torch.where(i > 0, crows[(i - 1).clamp(min=0)], torch.zeros_like(k))
        pc = torch.where(i > 0, ccost[(i - 1).clamp(min=0)], torch.zeros_like(k))
        full = pc + (k - pr) * density[cheap][i]
        i0 = torch.searchsorted(crows, offset).clamp(max=crows.numel() - 1)
        pr0 = torch.where(i0 > 0, crows[(i0 - 1).clamp(min=0)], torch.zeros_like(offset))
        pc0 = torch.where(i0 > 0, ccost[(i0 - 1).clamp(min=0)], torch.zeros_like(offset))
        return full - (pc0 + (offset - pr0) * density[cheap][i0])

    used = torch.zeros(m, 1, dtype=torch.float64)
    if m > 1:
        used[1:, 0] = (2 * L - hp.flatten()[:-1].to(torch.float64)).clamp(min=0).cumsum(0)
    left = head + fill(L - t, used)
    right = tail + fill(L - (hp - t), used + (L - t).clamp(min=0))
    cut = t.gather(1, torch.maximum(left, right).argmin(1, keepdim=True)).flatten()
    bounds = ((torch.arange(m, dtype=torch.float64) + 0.5) * (cp - 1) / m).floor().to(torch.int64) + 1

    # reserve the cheapest sequences for the ranks around the cuts; the rest follow the excess merge
    need = float((2 * L - hp.flatten()).clamp(min=0).sum())
    n_res = int(torch.searchsorted(crows, torch.tensor(need, dtype=torch.float64))) + 1
    reserved = cheap[:n_res].tolist()
    others = cheap[n_res:]
    stream = others[_excess_merge_order_of(prob, others, excess)].tolist() if others.numel() else []
    rows = prob.padded.tolist()
    out: list[int] = []
    x = 0
    ri = si = 0

    def place(f: int) -> None:
        nonlocal x
        out.append(f)
        x += rows[f]

    for h, c, r in zip(heavy.tolist(), cut.tolist(), bounds.tolist()):
        while x < (r - 1) * L and si < len(stream):
            place(stream[si])
            si += 1
        start = r * L - c
        while x < start and ri < len(reserved):
            f = reserved[ri]
            if x + rows[f] > start and (x + rows[f] - start) > (start - x):
                break  # stopping short is closer to the cut point than overshooting
            place(f)
            ri += 1
        place(h)
        end = (x // L + 1) * L if x % L else x
        while x < end and ri < len(reserved):
            place(reserved[ri])
            ri += 1
    out.extend(stream[si:])
    out.extend(reserved[ri:])
    return torch.tensor(out, dtype=torch.int64)


def _rank_bins_order(prob: BalanceProblem, giant: float = 0.9, sand: float = 0.002) -> torch.Tensor:
    """Fill the ``cp`` ranks as bins (rows and cost), then concatenate them: for many sequences.

    * giants (cost above ``giant`` of a mean rank, at most ``cp - 1``) straddle evenly spread
      rank boundaries, cut where their two ranks cost the same once the rest of both is sand;
    * other sequences above ``sand`` of a mean rank go, most costly first, to the rank with the
      most cost budget left once its share of the sand (rows left x sand cost per row) is
      reserved, among those with rows left for them;
    * sand fills the remaining rows: shortest first to the ranks needing the least cost per row;
    * inside a rank the shortest sequences sit at both edges, so the sequences cut by rank
      boundaries (other than giants) are cheap.
    Host NumPy; a Python loop over the non-sand sequences only.
    """
    cp, L = prob.cp_size, prob.local_rows
    rows = prob.padded.numpy().astype(np.int64)
    cost = prob.seq_cost.numpy()
    real = prob.seqlens.numpy()
    tau = prob.total_cost / cp
    cap = np.full(cp, float(L))
    cap[-1] -= prob.tail_rows
    budget = np.full(cp, tau)
    budget[-1] -= prob.tail_rows * prob.cost_model.pad_row_cost
    desc = np.argsort(-cost, kind="stable")
    is_sand = cost <= sand * tau
    rho = float(cost[is_sand].sum()) / max(float(rows[is_sand].sum()), 1.0)  # sand cost per row

    head: list[int | None] = [None] * cp  # giant cut by the boundary after rank b
    giants = [i for i in desc[: cp - 1].tolist() if cost[i] > giant * tau and 1 < rows[i] <= L]
    for k, i in enumerate(giants):
        b = int((k + 0.5) * (cp - 1) / len(giants))
        if head[b] is not None:
            continue
        t = torch.arange(1, int(rows[i]), dtype=torch.int64)
        head_cost = _partial(prob, torch.tensor(int(real[i])), t).numpy()
        # both ranks equal once the rest of their rows hold sand: F(t) + rho (L - t) = C - F(t) + rho (L - p + t)
        cut = int(np.argmin(np.abs(head_cost - rho * t.numpy() - (cost[i] - rho * rows[i]) / 2)))
        head[b] = i
        cap[b] -= cut + 1
        budget[b] -= head_cost[cut]
        cap[b + 1] -= rows[i] - (cut + 1)
        budget[b + 1] -= cost[i] - head_cost[cut]
    placed = np.zeros(rows.shape[0], dtype=bool)
    placed[[i for i in head if i is not None]] = True
    rest = desc[~placed[desc]]
    big, fine = rest[~is_sand[rest]], rest[is_sand[rest]]
    members: list[list[int]] = [[] for _ in range(cp)]
    for i in big.tolist():
        room = cap >= rows[i]
        b = int(np.argmax(np.where(room, budget - cap * rho, -np.inf))) if room.any() else int(np.argmax(cap))
        members[b].append(i)
        cap[b] -= rows[i]
        budget[b] -= cost[i]
    fine = fine[np.argsort(rows[fine], kind="stable")]
    by_need = np.argsort(budget / np.maximum(cap, 1.0), kind="stable")
    ends = np.cumsum(np.maximum(cap[by_need], 0.0))
    cum = np.cumsum(rows[fine])
    slot = np.searchsorted(ends, cum - rows[fine] / 2, side="right").clip(max=cp - 1)
    for k, b in enumerate(by_need.tolist()):
        members[b].extend(fine[slot == k].tolist())
    out: list[int] = []
    for b in range(cp):
        m = np.asarray(members[b], dtype=np.int64)
        m = m[np.argsort(rows[m], kind="stable")]
        out.extend(m[0::2].tolist())
        out.extend(m[1::2][::-1].tolist())
        if head[b] is not None:
            out.append(head[b])
    return torch.tensor(out, dtype=torch.int64)


def _candidates(prob: BalanceProblem) -> torch.Tensor:
    b = prob.num_seqs
    ident = torch.arange(b)
    longest = torch.argsort(prob.padded, descending=True, stable=True)
    excess = _excess(prob)
    cands = [ident, _excess_merge_order(prob, excess)]
    if b <= 256:  # cheap extra starting points where the local search is cheap too
        cands += [longest, _snake_order(prob), longest.flip(0)]
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
    return torch.stack(cands)


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

    def __init__(self, prob: BalanceProblem, order: torch.Tensor):
        self.order = order
        tail = torch.tensor([prob.tail_rows], dtype=torch.int64)
        self.rows = torch.cat([prob.padded[order], tail])
        self.cost = torch.cat([prob.seq_cost[order], tail.to(torch.float64) * prob.cost_model.pad_row_cost])
        self.real = torch.cat([prob.seqlens[order], torch.zeros(1, dtype=torch.int64)])
        self.cum_rows = torch.cat([torch.zeros(1, dtype=torch.int64), self.rows.cumsum(0)])
        self.cum_cost = torch.cat([torch.zeros(1, dtype=torch.float64), self.cost.cumsum(0)])


def _partial(prob: BalanceProblem, real: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Cost of the first ``off`` rows of a slot with ``real`` tokens (then padding)."""
    r = torch.minimum(off, real)
    return prob.cost_model.prefix_cost(r) + prob.cost_model.pad_row_cost * (off - r).to(torch.float64)


def _eval_moves(prob: BalanceProblem, cur: _Current, i: torch.Tensor, j: torch.Tensor, swap: torch.Tensor):
    """Per-rank costs ``[K, cp]`` after swapping (``swap``) or moving slot ``i`` to slot ``j``."""
    b = prob.num_seqs
    cr, cc, rows, cost = cur.cum_rows, cur.cum_cost, cur.rows, cur.cost
    x = prob._bounds.view(1, -1)
    lo, hi = torch.minimum(i, j), torch.maximum(i, j)
    fwd = i < j
    # item 1: swap -> the sequence of slot hi placed at slot lo; move -> the moved sequence (slot i)
    s1 = torch.where(swap, hi, i)
    start1 = torch.where(swap | ~fwd, cr[lo], cr[j + 1] - rows[i])
    ccs1 = torch.where(swap | ~fwd, cc[lo], cc[j + 1] - cost[i])
    # shifted range [a, b) of untouched slots
    d_rows = torch.where(swap, rows[hi] - rows[lo], torch.where(fwd, -rows[i], rows[i]))
    d_cost = torch.where(swap, cost[hi] - cost[lo], torch.where(fwd, -cost[i], cost[i]))
    a = torch.where(swap | fwd, lo + 1, lo)
    e = torch.where(swap, hi, torch.where(fwd, hi + 1, hi))
    # item 2 (swaps only): the sequence of slot lo placed at slot hi
    start2 = cr[hi] + d_rows
    ccs2 = cc[hi] + d_cost

    s1, start1, ccs1 = s1.view(-1, 1), start1.view(-1, 1), ccs1.view(-1, 1)
    start2, ccs2, lo2 = start2.view(-1, 1), ccs2.view(-1, 1), lo.view(-1, 1)
    d_rows, d_cost, a, e = d_rows.view(-1, 1), d_cost.view(-1, 1), a.view(-1, 1), e.view(-1, 1)

    base_slot = (torch.searchsorted(cr, prob._bounds, right=True) - 1).clamp(0, b).view(1, -1)
    y = x - d_rows
    y_slot = (torch.searchsorted(cr, y.contiguous(), right=True) - 1).clamp(0, b)
    in_shift = (y_slot >= a) & (y_slot < e) & (y >= 0)
    off1 = x - start1
    in1 = (off1 >= 0) & (off1 < rows[s1])
    off2 = x - start2
    in2 = swap.view(-1, 1) & (off2 >= 0) & (off2 < rows[lo2])

    slot = torch.where(in1, s1, torch.where(in2, lo2, torch.where(in_shift, y_slot, base_slot)))
    off = torch.where(in1, off1, torch.where(in2, off2, torch.where(in_shift, y - cr[y_slot], x - cr[base_slot])))
    ccs = torch.where(
        in1, ccs1, torch.where(in2, ccs2, torch.where(in_shift, cc[y_slot] + d_cost, cc[base_slot]))
    )
    g = ccs + _partial(prob, cur.real[slot], off)
    k = g.shape[0]
    g = torch.cat(
        [torch.zeros((k, 1), dtype=torch.float64), g, torch.full((k, 1), prob.total_cost, dtype=torch.float64)], 1
    )
    return g.diff(dim=1)


def _apply_move(order: torch.Tensor, i: int, j: int, swap: bool) -> torch.Tensor:
    out = order.clone()
    if swap:
        out[i], out[j] = order[j], order[i]
    elif i < j:
        out[i:j] = order[i + 1 : j + 1]
        out[j] = order[i]
    else:
        out[j + 1 : i + 1] = order[j:i]
        out[j] = order[i]
    return out


def _spread(lo: int, hi: int, count: int) -> torch.Tensor:
    """Up to ``count`` evenly spread integers in ``[lo, hi]`` (all of them when few)."""
    n = hi - lo + 1
    if n <= count:
        return torch.arange(lo, hi + 1)
    return torch.unique(torch.linspace(lo, hi, count).round().to(torch.int64))


def _neighbourhood(prob: BalanceProblem, cur: _Current, costs: torch.Tensor, max_moves: int):
    """(i, j, swap) of candidate moves around the most loaded rank.

    Sources: the slots touching the most loaded rank (its two straddlers and its most costly
    sequences always, the rest spread evenly). Targets: the slots next to every rank boundary
    (where a move changes which sequence straddles and where it is cut) plus slots spread over
    the whole buffer. Each (source, target) pair is tried as a swap and as a move either way.
    """
    b = prob.num_seqs
    cr = cur.cum_rows
    starts = torch.arange(prob.cp_size, dtype=torch.int64) * prob.local_rows
    first = (torch.searchsorted(cr, starts, right=True) - 1).clamp(0, b - 1)
    last = (torch.searchsorted(cr, starts + prob.local_rows - 1, right=True) - 1).clamp(0, b - 1)
    worst = int(costs.argmax())
    f, l = int(first[worst]), int(last[worst])
    n_src = max(4, int(math.sqrt(max_moves / 3)))
    heavy = f + torch.argsort(cur.cost[f : l + 1], descending=True, stable=True)[: max(1, n_src // 3)]
    src = torch.unique(torch.cat([torch.tensor([f, l]), heavy, _spread(f, l, n_src)]))
    n_dst = max(4, max_moves // (3 * src.numel()))
    near = (first[1:].view(-1, 1) + torch.arange(-1, 2).view(1, -1)).flatten().clamp(0, b - 1)
    dst = torch.unique(torch.cat([near[: n_dst // 2], _spread(0, b - 1, max(2, n_dst - near[: n_dst // 2].numel()))]))
    ii, jj = torch.meshgrid(src, dst, indexing="ij")
    ii, jj = ii.flatten(), jj.flatten()
    keep = ii != jj
    ii, jj = ii[keep], jj[keep]
    n = ii.numel()
    swap = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(2 * n, dtype=torch.bool)])
    i_all, j_all = torch.cat([ii, ii, jj]), torch.cat([jj, jj, ii])
    # a heavy sequence on the worst rank (over a quarter of a mean rank): try every slot for it,
    # i.e. every boundary and every cut point the other sequences allow
    top = int(heavy[0])
    if float(cur.cost[top]) > 0.25 * prob.total_cost / prob.cp_size:
        j = torch.arange(b)
        j = j[j != top]
        i_all = torch.cat([i_all, torch.full_like(j, top)])
        j_all = torch.cat([j_all, j])
        swap = torch.cat([swap, torch.zeros(j.numel(), dtype=torch.bool)])
    return i_all, j_all, swap


def _local_search(
    prob: BalanceProblem, order: torch.Tensor, costs: torch.Tensor, rounds: int, max_moves: int, good_enough: float
):
    mean = prob.total_cost / prob.cp_size
    for _ in range(rounds):
        if float(costs.max()) <= mean * good_enough:
            break
        cur = _Current(prob, order)
        i, j, swap = _neighbourhood(prob, cur, costs, max_moves)
        if i.numel() == 0:
            break
        cand_costs = _eval_moves(prob, cur, i, j, swap)
        k = _pick_best(cand_costs)
        if not _better(cand_costs[k], costs):
            break
        order = _apply_move(order, int(i[k]), int(j[k]), bool(swap[k]))
        costs = cand_costs[k]
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
    max_moves: int | None = None,
    good_enough: float = 1.005,
    kicks: int | None = None,
    exhaustive_max: int = 6,
) -> torch.Tensor:
    """Return the permutation ``order`` (int64 ``[B]``) minimising the largest per-rank cost.

    Buffer position ``k`` holds sequence ``order[k]``. ``problem`` may be given instead of the
    padding options (it carries padded lengths, e.g. taken from a layout plan). ``rounds`` bounds
    the local-search rounds (default: 4 for 1024 sequences, up to 48 for small batches);
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
    b = prob.num_seqs
    if prob.cp_size == 1 or b == 1:
        return torch.arange(b)
    if b <= exhaustive_max:
        return _exhaustive(prob)
    cands = _candidates(prob)
    cand_costs = prob.costs(cands)
    mean = prob.total_cost / prob.cp_size
    if b >= 4 * prob.cp_size and float(cand_costs.max(-1).values.min()) > mean * _BINS_BELOW:
        # many sequences and no good start yet (dense attention, heavy tails): fill ranks as bins
        cands = torch.cat([cands, _rank_bins_order(prob).view(1, -1)])
        cand_costs = torch.cat([cand_costs, prob.costs(cands[-1:])])
    if rounds is None:
        rounds = max(4, min(48, 4096 // b))
    if max_moves is None:
        max_moves = max(192, min(3072, (1 << 17) // b))
    if kicks is None:
        kicks = 0 if b > 64 else min(32, 512 // b)
    # local search from the two best starting points (a better start can end in a worse optimum)
    k = _pick_best(cand_costs)
    order, costs = _local_search(prob, cands[k], cand_costs[k], rounds, max_moves, good_enough)
    if cands.shape[0] > 1 and float(costs.max()) > (prob.total_cost / prob.cp_size) * good_enough:
        rest = torch.cat([torch.arange(k), torch.arange(k + 1, cands.shape[0])])
        k2 = int(rest[_pick_best(cand_costs[rest])])
        order2, costs2 = _local_search(prob, cands[k2], cand_costs[k2], rounds, max_moves, good_enough)
        if _better(costs2, costs):
            order, costs = order2, costs2
    # iterated local search: perturb the best order with two random moves, search again, keep
    # the result if it is better. The generator is seeded, so every rank gets the same answer.
    gen = torch.Generator().manual_seed(0x5EED)
    mean = prob.total_cost / prob.cp_size
    for _ in range(kicks):
        if float(costs.max()) <= mean * good_enough:
            break
        kicked = order
        for _ in range(2):
            i, j = torch.randint(0, b, (2,), generator=gen).tolist()
            if i != j:
                kicked = _apply_move(kicked, i, j, swap=bool(torch.rand((), generator=gen) < 0.5))
        kicked, kicked_costs = _local_search(prob, kicked, prob.costs(kicked), min(rounds, 16), max_moves, good_enough)
        if _better(kicked_costs, costs):
            order, costs = kicked, kicked_costs
    return order


def balanced_order_for_plan(seqlens, options: PlanOptions, cost_model: str | TokenCostModel | None = None):
    """The order ``build_plan(seqlens, options, order=...)`` uses when ``options.balance`` is set.

    Runs on the host (one device-to-host copy of the lengths when they live on an accelerator);
    the returned order is on the lengths' device.
    """
    seqlens = torch.as_tensor(seqlens)
    model = cost_model or getattr(options, "balance", None) or "ds4"
    prob = BalanceProblem.from_options(seqlens.detach().cpu(), options, model)
    return balance_order(None, cp_size=options.cp_size, problem=prob).to(seqlens.device)


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
