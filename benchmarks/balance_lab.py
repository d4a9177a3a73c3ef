"""Exploratory balancing heuristics and the straggler lower bound (not product code).

The product balancer is :mod:`verl_ds4.layout.balance` (its problem class, cost evaluation, excess
merge and rank bins are imported from there). This file keeps what the bench table did not need in
the product, for experiments:

  * extra starts: a snake partition by cost (:func:`_snake_order`), balancing walks that cut heavy
    sequences half-way through their excess (:func:`_heavy_walk_order`), and cuts where a heavy
    sequence's two ranks cost the same with the cheapest sequences reserved for them
    (:func:`_heavy_split_order`); :func:`extra_candidates` lists them for one problem;
  * the rank bins' former "cheapest filler first" step for ranks over budget (:func:`_cheap_filler_first`);
  * :func:`straggler_lower_bound`, the "bound" column of ``benchmarks/bench_cp_balance.py``.

The incremental O(cp) move evaluation and the swap family of the giant slide were dropped from the
product and this file; they are in the git history (``benchmarks/balance_lab.py`` before the slim
balancer at 400 lines).
"""

from __future__ import annotations

import numpy as np
import torch

from verl_ds4.layout.balance import _SMALL, BalanceProblem, _desc, _excess_merge_order

__all__ = ["extra_candidates", "straggler_lower_bound"]


def _excess_merge_order_of(prob: BalanceProblem, ids: np.ndarray) -> np.ndarray:
    """:func:`_excess_merge_order` of the subset ``ids`` (positions into ``ids``), around its own mean."""
    rows = prob.rows[ids].astype(np.float64)
    sub = prob.cost[ids]
    return _excess_merge_order(sub - float(sub.sum()) / max(float(rows.sum()), 1.0) * rows)


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


def extra_candidates(prob: BalanceProblem) -> list[np.ndarray]:
    """The exploratory starts for ``prob``: the cheap ones (plain, merge, and for small batches
    longest-first, snake, shortest-first) and the heavy-sequence constructions."""
    excess = _excess(prob)
    return _cheap_candidates(prob, excess) + _heavy_candidates(prob, excess)


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
