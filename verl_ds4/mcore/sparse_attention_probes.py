"""Small fixed CPU cases that run one of Megatron-LM ``dev``'s DS4 sparse-attention functions, or its
verl-ds4 replacement, forward and backward (:mod:`.sparse_attention_patch` compares the two at start-up).

Each probe takes the function, builds its inputs from a fixed seed (float32, several packed sequences,
invalid ``-1`` ids, a query row with no key, padding rows) and returns ``(labels, tensors)``: the outputs
and the gradients of a fixed random projection of them. The cases are tiny (tens of rows): a probe costs
milliseconds.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["PROBES", "probe_attention", "probe_cp1_indexer_loss", "probe_indexer_loss", "probe_topk"]


def _leaf(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).requires_grad_(True)


def _ids(gen: torch.Generator, rows: int, width: int, n_kv: int, invalid: float = 0.2) -> torch.Tensor:
    ids = torch.randint(0, n_kv, (rows, width), generator=gen, dtype=torch.int32)
    return ids.masked_fill(torch.rand(rows, width, generator=gen) < invalid, -1)


def _grads(value: torch.Tensor, leaves: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    weight = torch.randn(value.shape, generator=gen)
    return list(torch.autograd.grad((value * weight).sum(), leaves, allow_unused=True))


def probe_attention(fn: Callable) -> tuple[list[str], list[torch.Tensor]]:
    """``fn(query, kv_full, attn_sink, topk_indices, softmax_scale)`` on THD rows."""
    gen = torch.Generator().manual_seed(11)
    rows, heads, dim, n_kv = 40, 2, 8, 60
    q, kv, sink = _leaf(gen, rows, heads, dim), _leaf(gen, n_kv, dim), _leaf(gen, heads)
    ids = _ids(gen, rows, 10, n_kv)
    ids[3] = -1  # a row with no key: output 0, the sink takes all the mass
    out = fn(q, kv, sink, ids, dim**-0.5)
    return ["output", "grad query", "grad kv_full", "grad attn_sink"], [out.detach(), *_grads(out, [q, kv, sink], gen)]


def probe_topk(fn: Callable) -> tuple[list[str], list[torch.Tensor]]:
    """``fn(q, k, weights, index_topk, mask, varlen_starts, varlen_ends)`` for two packed sequences of
    12 rows with 3 compressed keys each (ratio 4): each row sees its own sequence's completed blocks."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(24, 1, 2, 8, generator=gen)
    k = torch.randn(6, 1, 8, generator=gen)
    weights = torch.randn(24, 1, 2, generator=gen)
    pos = torch.arange(24) % 12
    starts = (torch.arange(24) // 12) * 3
    ends = starts + (pos + 1) // 4
    _, ids = fn(q, k, weights, 2, None, starts, ends)
    return ["topk ids"], [ids]


def probe_indexer_loss(fn: Callable) -> tuple[list[str], list[torch.Tensor]]:
    """``fn(...)`` with Megatron's ``_unfused_indexer_sparse_attn_from_topk`` signature, dense indexer loss:
    two sequences (20 and 12 rows, the last two rows padding), ratio 4, compressed keys 5 + 3."""
    gen = torch.Generator().manual_seed(13)
    rows, heads, dim, n_kv, idx_heads, idx_dim, top = 32, 2, 8, 48, 2, 8, 3
    query, kv_full, sink = _leaf(gen, rows, heads, dim), _leaf(gen, n_kv, dim), _leaf(gen, heads)
    q_idx, k_idx, weights = _leaf(gen, rows, idx_heads, idx_dim), _leaf(gen, 8, idx_dim), _leaf(gen, rows, idx_heads)
    compressed = torch.randn(8, dim, generator=gen)
    topk_ids = _ids(gen, rows, top + 6, n_kv)
    indexer_ids = _ids(gen, rows, top, 8)
    layout = (torch.tensor([0, 20, 32], dtype=torch.int32), torch.tensor([0, 5, 8], dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    padding = torch.zeros(rows, dtype=torch.bool)
    padding[-2:] = True
    out, loss = fn(query, kv_full, sink, topk_ids, q_idx, k_idx, weights, indexer_ids, compressed, dim**-0.5, idx_dim**-0.5,
                   0.5, 30.0, False, 4, 20, layout, padding)  # fmt: skip
    leaves = [query, kv_full, sink, q_idx, k_idx, weights]
    grads = list(torch.autograd.grad((out * torch.randn(out.shape, generator=gen)).sum() + 3.0 * loss, leaves, allow_unused=True))
    grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
    labels = ["output", "indexer loss", *(f"grad {n}" for n in ("query", "kv_full", "attn_sink", "q_indexer", "k_indexer", "weights"))]
    return labels, [out.detach(), loss.detach().reshape(1), *grads]


def probe_cp1_indexer_loss(loss_class) -> tuple[list[str], list[torch.Tensor]]:
    """``loss_class.apply(...)`` with ``dsa.FusedDSAIndexerLoss``'s arguments as Megatron's CP 1 THD path passes them:
    two sequences (20 and 12 rows, the last two padding), ratio 4, top-2, the dense and then the sparse loss."""
    import types

    labels, tensors = [], []
    for sparse in (False, True):
        gen = torch.Generator().manual_seed(14)
        rows, idx_heads, idx_dim, heads, dim, keys = 32, 2, 8, 3, 8, 8
        q, w, k = _leaf(gen, rows, 1, idx_heads, idx_dim), _leaf(gen, rows, 1, idx_heads), _leaf(gen, keys, 1, idx_dim)
        query = torch.randn(rows, heads, dim, generator=gen)
        key = torch.randn(keys, dim, generator=gen).unsqueeze(1).expand(-1, heads, -1)
        pos = torch.cat([torch.arange(20), torch.arange(12)])
        starts = torch.cat([torch.zeros(20, dtype=torch.long), torch.full((12,), 5)])
        ends = starts + (pos + 1) // 4
        valid = torch.ones(rows, dtype=torch.bool)
        valid[-2:] = False
        starts, ends = torch.where(valid, starts, 0), torch.where(valid, ends, 0)
        lse = torch.randn(1, heads, rows, generator=gen)
        groups = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
        ids, loss = loss_class.apply(q, w, k, query, key, dim**-0.5, 2, 0.5, None, sparse, groups, starts, ends, None, valid,
                                     False, True, lse)  # fmt: skip
        grads = torch.autograd.grad(3.0 * loss, [q, w, k])
        kind = "sparse" if sparse else "dense"
        labels += [f"{kind} topk ids", f"{kind} indexer loss", f"{kind} grad q", f"{kind} grad weights", f"{kind} grad k"]
        tensors += [ids, loss.detach().reshape(1), *grads]
    return labels, tensors


PROBES: dict[str, Callable] = {
    "unfused_compressed_sparse_attn": probe_attention,
    "fused_qk_topk_naive": probe_topk,
    "_unfused_indexer_sparse_attn_from_topk": probe_indexer_loss,
    "FusedDSAIndexerLoss": probe_cp1_indexer_loss,
}
