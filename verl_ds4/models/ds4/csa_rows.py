"""The DS4 attention's per-query work on compressed blocks (CSA / HCA), in row chunks (:mod:`verl_ds4.models.query_chunks`).

:class:`Selection` holds what is shared by all query rows of a compressed layer (the compressed KV ``[NB, d]``,
the blocks' sequence and index, the queries' sequence and position, the indexer's keys) and the choice of the
CSA indexer as compact ids ``[T, k]`` (:func:`choose`: scores, top-k and the indexer replay, ``chunk`` rows at a
time, no gradient). :func:`attend_rows` then runs, chunk by chunk under a checkpoint, the attention over each
row's window keys and chosen blocks (the dense core: every block of the buffer, masked; the linear core runs
:func:`verl_ds4.kernels.linear_sparse_attn` over all rows with each row's ids) and the indexer's KL term
(:mod:`.indexer_loss`). No ``[T, NB]`` tensor of the whole rank exists; per row the operations are those of a
single pass over all rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verl_ds4.kernels import linear_sparse_attn

from ..query_chunks import chunk_bounds, query_chunk_rows, run_rows

__all__ = ["Selection", "attend_rows", "block_ids", "choose", "stable_top"]


def block_ids(chosen: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """``[T, K]`` ids of the true columns of ``chosen [T, NB]`` plus ``offset``, in block order, ``-1`` past each
    row's count (``K`` = the most true columns of any row). No sort: each true column goes to the slot its running
    count names (one pass over ``[T, NB]``)."""
    rows, nb = chosen.shape
    width = int(chosen.sum(dim=1).max()) if chosen.numel() else 0
    slot = torch.where(chosen, chosen.cumsum(dim=1) - 1, width)  # columns past a row's count land in a dropped slot
    columns = torch.arange(offset, offset + nb, device=chosen.device).expand(rows, nb)
    out = torch.full((rows, width + 1), -1, dtype=torch.long, device=chosen.device)
    return out.scatter_(1, slot, columns)[:, :width].masked_fill_(torch.arange(width, device=chosen.device) >= chosen.sum(dim=1, keepdim=True), -1)


@dataclass
class Selection:
    """A compressed layer's blocks and what each local query row may attend (see the module doc)."""

    comp: torch.Tensor  # [NB, d] compressed KV of every block of the buffer (gathered over CP)
    block_seq: torch.Tensor  # [NB] sequence of each block
    block_idx: torch.Tensor  # [NB] index of each block inside its sequence
    ratio: int
    q_seq: torch.Tensor  # [T] sequence of each local query row
    q_pos: torch.Tensor  # [T] position of each local query row in its sequence
    ids: torch.Tensor | None = None  # [T, k] blocks chosen by the indexer (buffer ids, -1: none); None: every visible block (HCA)
    index_inputs: tuple | None = None  # (x, q_r detached, indexer keys [NB, d_I], cos, sin) of a CSA layer
    with_loss: bool = False  # the indexer loss runs in this forward
    real: torch.Tensor | None = None  # [T] bool: the real (not padding) rows, the indexer loss's queries; None: all

    def visible(self, start: int, end: int) -> torch.Tensor:
        """``[c, NB]``: the blocks rows ``start..end`` may see (own sequence, completed before the row)."""
        same = self.block_seq.unsqueeze(0) == self.q_seq[start:end].unsqueeze(1)
        return same & (self.block_idx.unsqueeze(0) < ((self.q_pos[start:end] + 1) // self.ratio).unsqueeze(1))

    def attended(self, start: int, end: int) -> torch.Tensor:
        """``[c, NB]``: the blocks rows ``start..end`` attend to (the indexer's choice among the visible ones)."""
        visible = self.visible(start, end)
        if self.ids is None:
            return visible
        ids = self.ids[start:end]
        nb = visible.shape[1]
        chosen = torch.zeros(ids.shape[0], nb + 1, dtype=torch.bool, device=ids.device)
        chosen.scatter_(1, torch.where(ids >= 0, ids, nb), True)
        return visible & chosen[:, :nb]


def _chunk_rows(attn, sel: Selection) -> int:
    heads = max(attn.spec.num_heads, attn.spec.index_n_heads if attn.indexer is not None else 0)
    return query_chunk_rows(sel.comp.shape[0], heads, sel.comp.element_size(), getattr(attn, "query_chunk_rows", None))


def choose(attn, sel: Selection, n_blocks: torch.Tensor, first_block: torch.Tensor) -> None:
    """Set ``sel.ids``: each local row's ``index_topk`` best visible blocks by the indexer's scores (equal scores in
    block order), or the replayed choice (``attn.indexer_replay``), chunk by chunk without gradient."""
    rows, nb = sel.q_seq.numel(), sel.block_seq.numel()
    k = min(attn.spec.index_topk, nb)
    x, q_r, keys, cos, sin = sel.index_inputs
    out = torch.full((rows, k), -1, dtype=torch.long, device=keys.device)
    replay = getattr(attn, "indexer_replay", None)
    with torch.no_grad():
        for start, end in chunk_bounds(rows, _chunk_rows(attn, sel)):
            visible = sel.visible(start, end)
            scores = attn.indexer.scores(x[start:end], q_r[start:end], keys, cos[start:end], sin[start:end]).masked_fill(~visible, float("-inf"))
            chosen = stable_top(scores, k)
            if replay is not None:  # rollout indexer replay (record / replay)
                chosen = attn._replayed_choice(chosen & visible, visible, n_blocks, first_block, sel.q_seq[start:end], start, rows)
            ids = block_ids(visible & chosen)
            out[start:end, : ids.shape[1]] = ids
    sel.ids = out


def stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[c, NB]`` bool: each row's ``k`` largest scores, equal scores taken in column order (what a stable descending
    sort's first ``k`` are), without sorting the row: everything above the ``k``-th value, then the first columns
    equal to it until ``k`` are taken."""
    if k >= scores.shape[1]:
        return torch.ones_like(scores, dtype=torch.bool)
    kth = torch.topk(scores, k, dim=1).values[:, -1:]
    above = scores > kth
    tie = scores == kth
    return above | (tie & (tie.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))


def _window_logits(q, kv_win, win_visible, scale) -> torch.Tensor:
    """``[c, n, W]`` scaled logits of each query over its window keys ``kv_win [c, W, d]`` (-inf where not visible)."""
    return torch.einsum("tnd,twd->tnw", q, kv_win).masked_fill(~win_visible.unsqueeze(1), float("-inf")) * scale


def _rows(attn, sel: Selection | None, start: int, end: int, win_visible, scale: float, attend: bool, loss: bool,
          q, kv_win, sink, comp=None, keys=None):  # fmt: skip
    """Rows ``start..end``: ``(the dense core's output [c, n, d] or None, the indexer KL sum or None)``."""
    rows, n, _ = q.shape
    win_logits = _window_logits(q, kv_win, win_visible, scale)
    out = kl = None
    if attend:  # softmax over [window keys, every compressed block of the buffer (masked), sink]
        logits = [win_logits]
        if comp is not None:
            logits.append(torch.einsum("tnd,bd->tnb", q, comp).masked_fill(~sel.attended(start, end).unsqueeze(1), float("-inf")) * scale)
        probs = torch.cat(logits + [sink.view(1, n, 1).expand(rows, n, 1)], dim=-1).softmax(dim=-1)
        w = win_logits.shape[-1]
        out = torch.einsum("tnw,twd->tnd", probs[..., :w], kv_win)
        if comp is not None:
            out = out + torch.einsum("tnb,bd->tnd", probs[..., w:-1], comp)
    if loss:
        from . import indexer_loss

        x, q_r, _, cos, sin = sel.index_inputs
        scores = attn.indexer.scores(x[start:end], q_r[start:end], keys, cos[start:end], sin[start:end])
        valid = sel.visible(start, end)
        if sel.real is not None:  # padding rows are no queries (they would see real blocks)
            valid = valid & sel.real[start:end].unsqueeze(1)
        kl = indexer_loss.indexer_kl_sum(q, comp, win_logits, sink, valid, scores, scale)
    return out, kl


def attend_rows(attn, q, kv, key_rows, win_visible, sel: Selection | None, scale: float):
    """``([T, n, d], the indexer KL sum or None)`` of the layer ``attn`` (sliding: ``sel`` None)."""
    sink = attn.attn_sink
    linear = attn.sparse_core == "linear"
    if linear:  # each row's ids into [kv ; comp]: its chosen blocks, then its window rows (Megatron-LM dev's layout)
        ids, kv_full = torch.where(win_visible, key_rows, -1), kv
        if sel is not None:
            parts = [attn_ids for attn_ids in _block_ids_by_chunk(attn, sel, kv.shape[0])]
            width = max((p.shape[1] for p in parts), default=0)
            blocks = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])
            ids, kv_full = torch.cat([blocks, ids], dim=1), torch.cat([kv, sel.comp])
        out = linear_sparse_attn(q, kv_full, sink, ids, scale).view(q.shape)
    loss = sel is not None and sel.with_loss
    if linear and not loss:
        return out, None
    kv_win = kv[key_rows.clamp(min=0)]  # [T, W, d]
    if sel is None:
        return _rows(attn, None, 0, q.shape[0], win_visible, scale, True, False, q, kv_win, sink)
    chunk = _chunk_rows(attn, sel)
    outs, kls = [], []
    extra = (sel.index_inputs[2],) if loss else ()
    for (start, end), q_c, kv_c in zip(chunk_bounds(q.shape[0], chunk), q.split(chunk), kv_win.split(chunk)):
        fn = functools.partial(_rows, attn, sel, start, end, win_visible[start:end], scale, not linear, loss)
        out_c, kl_c = run_rows(fn, q_c, kv_c, sink, sel.comp, *extra)
        outs.append(out_c)
        kls.append(kl_c)
    kl = functools.reduce(torch.add, kls) if loss else None
    return (out if linear else torch.cat(outs)), kl


def _block_ids_by_chunk(attn, sel: Selection, offset: int):
    with torch.no_grad():
        for start, end in chunk_bounds(sel.q_seq.numel(), _chunk_rows(attn, sel)):
            yield block_ids(sel.attended(start, end), offset=offset)
