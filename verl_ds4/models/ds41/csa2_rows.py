"""V4.1 CSA2's per-query work in row chunks (:mod:`verl_ds4.models.query_chunks`): memory O(chunk x entries).

A CSA2 layer's query row scores every entry of its own sequence (the indexer), keeps the best ``index_topk``
(within a hierarchical layer's candidate blocks) and attends to its window keys and those entries. Done for all
``T`` local rows at once that is ``[T, E]`` scores, masks and gathered keys (``E``: a sequence's entries, ``S / m``;
at ratio 1 and 32k tokens, 1G values per tensor). Here:

* :func:`choose` (no gradient) scores, ranks and replays the choice ``chunk`` rows at a time and keeps each row's
  choice as compact ids ``[T, index_topk]`` (entries counted from the row's sequence's first entry, ascending,
  ``-1`` past its count) and, on the candidate-source layer, its candidate blocks as ids
  ``[T, candidate_topk_blocks]``. A chunk inside one sequence scores only the entries its rows reach (``(pos + 1)
  // m`` of its last row) against that sequence's index keys ``[E', d_I]``, shared by its rows; a chunk across
  sequences gathers each row's own sequence's keys ``[c, E, d_I]`` (:func:`own_entries`). Unreached
  entries score ``-inf`` and are never chosen, so the width changes no choice;
* :func:`attend` (the dense core) runs the attention over each row's window keys and chosen entries (``W + k``
  keys per row: an unchosen entry is masked to ``-inf`` and adds an exact zero, so leaving it out changes no term)
  chunk by chunk under a non-reentrant checkpoint (:func:`~verl_ds4.models.query_chunks.run_rows`);
* :func:`global_ids` turns the compact ids into rows of the buffer's compressed KV (the linear core's ids).

Per row the operations are those of a single pass over all rows (the chunk test: ``tests/test_ds41_csa2_rows_on_cpu.py``).
"""

from __future__ import annotations

import functools

import torch

from ..ds4.csa_rows import block_ids
from ..query_chunks import chunk_bounds, query_chunk_rows, run_rows

__all__ = ["attend", "choose", "compact", "entry_counts", "first_entries", "global_ids", "ids_mask", "own_entries"]


def entry_counts(cu: torch.Tensor, m: int) -> torch.Tensor:
    """``[B]``: each sequence's entries (its complete blocks of ``m`` rows; a trailing incomplete block is none)."""
    return (cu[1:] - cu[:-1]) // m


def first_entries(cu: torch.Tensor, m: int) -> torch.Tensor:
    """``[B]``: the index (into the buffer's entries, sequence by sequence) of each sequence's first entry."""
    n_blocks = entry_counts(cu, m)
    return torch.cumsum(n_blocks, 0) - n_blocks


def own_entries(cu: torch.Tensor, m: int, q_seq: torch.Tensor) -> torch.Tensor:
    """``[T, E]``: for each query (its sequence ``q_seq``), the indices into the buffer's entries
    (:func:`first_entries`' order) of its sequence's entries ``0..E-1``, where ``E`` is the most entries of any
    sequence; columns past the query's sequence's own count repeat a valid index (callers mask them:
    an entry ``e`` is visible only when ``e < (pos + 1) // m``). A query never needs another sequence's
    entries, so attention and indexer scores cost ``T * E``, not ``T * W`` over the whole packed buffer."""
    n_blocks = entry_counts(cu, m)
    width = int(n_blocks.max()) if n_blocks.numel() else 0
    index = first_entries(cu, m)[q_seq].unsqueeze(1) + torch.arange(width, device=cu.device)
    return index.clamp(max=max(int(n_blocks.sum()) - 1, 0))


def compact(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[c, width]`` ids of the true columns of ``mask`` ``[c, E]``, ascending, ``-1`` past each row's count."""
    ids = block_ids(mask)
    if ids.shape[1] > width:
        raise ValueError(f"a row chose {ids.shape[1]} entries, expected at most {width}.")  # error-catalogue: internal: top-k and the replay choose at most k
    return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)


def ids_mask(ids: torch.Tensor, width: int) -> torch.Tensor:
    """``[c, width]`` bool: the columns ``ids`` ``[c, k]`` names (``-1`` and ids ``>= width`` name none)."""
    column = torch.where((ids >= 0) & (ids < width), ids, width)
    out = torch.zeros(ids.shape[0], width + 1, dtype=torch.bool, device=ids.device)
    return out.scatter_(1, column, True)[:, :width]


def global_ids(ids: torch.Tensor, cu: torch.Tensor, m: int, q_seq: torch.Tensor) -> torch.Tensor:
    """Own-sequence entry ids ``[T, k]`` -> ids into the buffer's entries (``-1`` stays)."""
    return torch.where(ids >= 0, first_entries(cu, m)[q_seq].unsqueeze(1) + ids, -1)


def choose(attn, x, q_r, cos, sin, cu, q_seq, q_pos, state, top_k) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(selection [T, index_topk], candidate blocks [T, candidate_topk_blocks] or the state's)`` of the Full /
    Reindex layer ``attn`` (see the module doc), without gradient; ``top_k(scores, k)``: the ``[c, E']`` bool mask
    of each row's ``k`` best (:func:`.csa2.stable_topk_mask`)."""
    m, indexer = attn.role.ratio, attn.core_attention.indexer
    rows, k = x.shape[0], attn.index_topk
    first = first_entries(cu, m)
    source, hierarchical = attn.is_candidate_source, not attn.is_candidate_source and attn.role.candidate_source is not None
    if hierarchical and state.candidate_blocks is None:
        raise ValueError(f"hierarchical layer {attn.role.layer} needs the candidates of layer {attn.role.candidate_source}.")
    chunk = query_chunk_rows(state.width, max(indexer.n_heads, 1), x.element_size(), getattr(attn, "query_chunk_rows", None))
    selection = torch.full((rows, k), -1, dtype=torch.long, device=x.device)
    candidates = torch.full((rows, attn.candidate_blocks), -1, dtype=torch.long, device=x.device) if source else state.candidate_blocks
    replay = getattr(attn, "indexer_replay", None)
    with torch.no_grad():
        for start, end in chunk_bounds(rows, chunk):
            reach = _reach(q_pos, m, start, end)
            one = bool(q_seq[start] == q_seq[end - 1])  # rows are in buffer order: one sequence
            width = int(reach.max()) if one else state.width
            reachable = torch.arange(width, device=x.device) < reach.unsqueeze(1)  # [c, width]
            if width:  # one sequence: its entries 0..width-1, shared; else each row's own sequence's entries
                keys = state.index_keys[int(first[q_seq[start]]) :][:width] if one else state.index_keys[own_entries(cu, m, q_seq[start:end])]
                scores = indexer.scores(x[start:end], q_r[start:end], keys, cos[start:end], sin[start:end]).masked_fill(~reachable, float("-inf"))
            else:
                scores = x.new_zeros(end - start, 0)
            if source:
                candidates[start:end] = attn._candidate_blocks(scores, reachable)
            elif hierarchical:
                scores = scores.masked_fill(~attn._candidate_mask(candidates[start:end], width), float("-inf"))
            selected = top_k(scores, k)
            if replay is not None:  # rollout indexer replay (record / replay), chunk by chunk in row order
                selected = replay.select(selected, reachable, start, rows)
            selection[start:end] = compact(selected & reachable, k)
    return selection, candidates


def _reach(q_pos, m: int, start: int, end: int) -> torch.Tensor:
    """``[c]``: how many entries rows ``start..end`` reach (``(pos + 1) // m``)."""
    return (q_pos[start:end] + 1) // m


def _rows(attn, window_rows, window_visible, ids, q, kv, comp):
    """Rows of one chunk: ``[c, n, d]`` attention over their window keys and chosen entries."""
    keys, visible = [kv[window_rows.clamp(min=0)]], [window_visible]
    if comp is not None:
        keys.append(comp[ids.clamp(min=0)])
        visible.append(ids >= 0)
    return attn._core(q, torch.cat(keys, dim=1), torch.cat(visible, dim=1))


def attend(attn, q, kv, window_rows, window_visible, comp=None, ids=None) -> torch.Tensor:
    """``[T, n, d]``: the dense core over each row's window keys (``window_rows`` into ``kv``) and the entries
    ``ids`` ``[T, k]`` names in ``comp`` (None: a window-only layer), chunk by chunk under a checkpoint."""
    width = window_rows.shape[1] + (0 if ids is None else ids.shape[1])
    chunk = query_chunk_rows(width, attn.n_heads, q.element_size(), getattr(attn, "query_chunk_rows", None))
    recompute = getattr(attn, "query_chunk_recompute", True)
    outs = []
    for start, end in chunk_bounds(q.shape[0], chunk):
        fn = functools.partial(_rows, attn, window_rows[start:end], window_visible[start:end], None if ids is None else ids[start:end])
        outs.append(run_rows(fn, q[start:end], kv, comp, recompute=recompute))
    return torch.cat(outs) if len(outs) != 1 else outs[0]
