"""DS4 / V4.1 sparse attention whose memory is linear in the query rows (row-chunked, flash-style backward).

One query row ``i`` attends to the keys its ids name (``topk_indices[i]``: window rows and the
compressed blocks its indexer chose, ``-1`` = no key), one shared K = V head (MQA) and a learnable
per-head sink that sits in the softmax's denominator only::

    s_k = scale * q_i . kv[id_k]          (computed in float32, or float64 for float64 inputs)
    o_i = sum_k exp(s_k) kv[id_k] / (sum_k exp(s_k) + exp(sink))

This is the math of Megatron-LM ``dev``'s ``unfused_compressed_sparse_attn`` (``csa.py``) with the same
signature, layouts and output dtype. Megatron's function gathers with
``torch.gather(kv.unsqueeze(0).expand(rows, -1, -1), ...)``, whose backward allocates the expanded input
``[rows, n_kv, d]`` (quadratic in a GPU's packed tokens), and autograd keeps the float32 gathered keys
``[rows, K, d]`` and several ``[rows, heads, K]`` score tensors for backward. Here:

* keys are gathered with ``index_select`` and their gradient is scattered with ``index_add_`` into
  ``[n_kv, d]``: nothing is ever expanded;
* query rows are processed in chunks of ``chunk_rows`` (default: what :data:`DEFAULT_CHUNK_BYTES` of
  backward work space holds, :func:`chunk_rows_for`), so the largest transient is bounded by the chunk;
* for backward only the inputs, the ids and the log-sum-exp ``[rows, heads]`` are kept; the backward
  recomputes each chunk's scores, probabilities and output from them (the flash-attention identity
  ``dS = P * (dP - rowsum(dO * O))``, with the sink's gradient ``-sum exp(sink - lse) * rowsum(dO * O)``).

Kept for backward per query row beyond the inputs (query, KV, ids): ``heads`` float32 log-sum-exps, against
Megatron's float32 ``[K, d]`` gathered keys, float32 query copy and score chain (DS4-Flash CSA, 64 heads,
head dim 512, 640 ids, bf16: 256 B against 1.69 MiB per token, measured with saved-tensor hooks;
``benchmarks/results/linear_sparse_attn_cpu.md``).

Ids outside ``[-1, n_kv)`` raise a ``ValueError`` naming the bad id (one device-to-host read per call).
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "SPARSE_CORES", "chunk_rows_for", "linear_sparse_attn", "set_sparse_core", "sparse_attn_reference"]

#: How a DS4 / V4.1 CPU attention computes its sparse softmax: ``dense`` (every key of the buffer, masked: the
#: reference) or ``linear`` (each query's ids through :func:`linear_sparse_attn`). An attention module that can
#: do both has a ``sparse_core`` attribute (the CPU models in :mod:`verl_ds4.models`).
SPARSE_CORES = ("dense", "linear")


def set_sparse_core(model: torch.nn.Module, core: str) -> int:
    """Set ``sparse_core`` on every module of ``model`` that has one; returns how many modules took it."""
    if core not in SPARSE_CORES:
        raise ValueError(f"sparse core {core!r}: expected one of {list(SPARSE_CORES)}.")  # error-catalogue: internal: callers pass a checked choice
    count = 0
    for module in model.modules():
        if hasattr(module, "sparse_core"):
            module.sparse_core = core
            count += 1
    return count

#: Backward work space one chunk of query rows may take (its gathered keys and their gradient in the
#: compute dtype, and four ``[rows, heads, K]`` score-shaped tensors). 256 MiB: 73 rows at
#: DS4-Flash widths (64 heads, head dim 512, 640 keys per row).
DEFAULT_CHUNK_BYTES = 256 * 1024**2


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16- and 32-bit inputs (as Megatron's ``.float()``), float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows_for(heads: int, head_dim: int, keys: int, dtype: torch.dtype, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Query rows per chunk so that one chunk's backward work space stays within ``budget_bytes``."""
    item = torch.empty((), dtype=_compute_dtype(dtype)).element_size()
    per_row = item * (2 * keys * head_dim + 4 * heads * keys + 3 * heads * head_dim)
    return max(1, int(budget_bytes) // max(per_row, 1))


def _id_range(ids: torch.Tensor) -> tuple[int, int]:
    """The smallest and the largest id (one device-to-host read)."""
    low, high = torch.aminmax(ids)
    return tuple(int(v) for v in torch.stack((low, high)).tolist())


def _check_inputs(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, ids: torch.Tensor) -> None:
    rows, heads, dim = q.shape
    if kv.ndim != 2 or kv.shape[1] != dim:
        raise ValueError(f"sparse attention: kv_full must be [n_kv, {dim}] (one MQA head of the query's head dim), got {tuple(kv.shape)}.")  # error-catalogue: internal: the attention layer passes matching shapes
    if ids.ndim != 2 or ids.shape[0] != rows:
        raise ValueError(f"sparse attention: topk_indices must be [{rows}, topk] (one id list per query row), got {tuple(ids.shape)}.")  # error-catalogue: internal: the attention layer passes matching shapes
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse attention: topk_indices must be int32 or int64 ids, got {ids.dtype}.")  # error-catalogue: internal: the attention layer passes integer ids
    if sink.numel() != heads:
        raise ValueError(f"sparse attention: attn_sink must hold one value per head ({heads}), got {tuple(sink.shape)}.")  # error-catalogue: internal: the attention layer passes its own sink
    if ids.numel():
        low, high = _id_range(ids)
        if low < -1 or high >= kv.shape[0]:
            bad = low if low < -1 else high
            raise ValueError(
                f"sparse attention: key id {bad} is outside the KV buffer: ids must be -1 (no key) or in [0, {kv.shape[0]}) "
                f"(kv_full has {kv.shape[0]} rows). The top-k ids were built for another buffer: check the window / "
                "compressed offsets and, under CP, that the ids index the gathered (global) compressed KV."
            )  # error-catalogue: internal: Megatron's layers and the CPU models build ids inside the buffer


def _chunk(q, kv, sink, ids, start, end, scale, cd):
    """One chunk's gathered keys ``[c, K, d]``, validity ``[c, K]``, query and scores ``[c, h, K]`` (masked)."""
    chunk_ids = ids[start:end]
    valid = chunk_ids >= 0
    keys = kv.index_select(0, chunk_ids.clamp(min=0).reshape(-1)).reshape(*chunk_ids.shape, kv.shape[1]).to(cd)
    qc = q[start:end].to(cd)
    scores = torch.einsum("rhd,rkd->rhk", qc, keys) * scale
    return keys, valid, qc, scores.masked_fill(~valid.unsqueeze(1), float("-inf"))


class _LinearSparseAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sink, ids, scale: float, chunk_rows: int):
        rows, heads, dim = q.shape
        cd = _compute_dtype(q.dtype)
        out = q.new_empty(rows, heads, dim)
        lse = torch.empty(rows, heads, dtype=cd, device=q.device)
        sink_c = sink.detach().reshape(1, heads).to(cd)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            keys, _, _, scores = _chunk(q, kv, sink, ids, start, end, scale, cd)
            top = torch.maximum(scores.amax(dim=-1), sink_c)  # [c, h]; the sink keeps it finite
            expd = torch.exp(scores - top.unsqueeze(-1))
            denom = expd.sum(dim=-1) + torch.exp(sink_c - top)
            out[start:end] = torch.einsum("rhk,rkd->rhd", expd / denom.unsqueeze(-1), keys).to(q.dtype)
            lse[start:end] = top + torch.log(denom)
        ctx.save_for_backward(q, kv, sink, ids, lse)
        ctx.scale, ctx.chunk_rows = scale, chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, sink, ids, lse = ctx.saved_tensors
        scale, chunk_rows = ctx.scale, ctx.chunk_rows
        rows, heads, dim = q.shape
        cd = lse.dtype
        need_q, need_kv, need_sink = ctx.needs_input_grad[:3]
        grad_q = torch.zeros_like(q) if need_q else None
        grad_kv = torch.zeros(kv.shape, dtype=cd, device=kv.device) if need_kv else None
        grad_sink = torch.zeros(heads, dtype=cd, device=q.device)
        sink_c = sink.detach().reshape(1, heads).to(cd)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            keys, valid, qc, scores = _chunk(q, kv, sink, ids, start, end, scale, cd)
            chunk_lse = lse[start:end]
            probs = torch.exp(scores - chunk_lse.unsqueeze(-1))  # [c, h, K]; 0 where no key
            d_out = grad_out[start:end].to(cd)
            out = torch.einsum("rhk,rkd->rhd", probs, keys)
            d_probs = torch.einsum("rhd,rkd->rhk", d_out, keys)
            delta = (d_out * out).sum(dim=-1)  # [c, h]: rowsum(dO * O)
            d_scores = probs * (d_probs - delta.unsqueeze(-1))
            if need_sink:
                grad_sink -= (torch.exp(sink_c - chunk_lse) * delta).sum(dim=0)
            if need_q:
                grad_q[start:end] = (torch.einsum("rhk,rkd->rhd", d_scores, keys) * scale).to(q.dtype)
            if need_kv:
                d_keys = torch.einsum("rhk,rhd->rkd", probs, d_out) + torch.einsum("rhk,rhd->rkd", d_scores, qc) * scale
                d_keys = d_keys.masked_fill(~valid.unsqueeze(-1), 0.0)
                grad_kv.index_add_(0, ids[start:end].clamp(min=0).reshape(-1), d_keys.reshape(-1, dim))
        return (
            grad_q,
            grad_kv.to(kv.dtype) if need_kv else None,
            grad_sink.to(sink.dtype).reshape(sink.shape) if need_sink else None,
            None,
            None,
            None,
        )


def _to_flat(query, kv_full, topk_indices):
    """THD (3-D query) passes through; SBHD ``(sq, b, h, d)`` / ``(n_kv, b, d)`` / ``(b, sq, K)`` local ids
    become b-major flat rows with ids offset by ``batch * n_kv`` (``-1`` stays ``-1``)."""
    if query.ndim == 3:
        return query, kv_full, topk_indices, None
    if query.ndim != 4 or kv_full.ndim != 3:
        raise ValueError(
            f"sparse attention: query must be THD [rows, heads, d] with kv_full [n_kv, d], or SBHD [sq, b, heads, d] "
            f"with kv_full [n_kv, b, d]; got query {tuple(query.shape)}, kv_full {tuple(kv_full.shape)}."
        )  # error-catalogue: internal: the attention layer passes one of its two layouts
    sq, b, heads, dim = query.shape
    n_kv = kv_full.shape[0]
    if topk_indices.ndim != 3 or topk_indices.shape[:2] != (b, sq):
        raise ValueError(f"sparse attention: SBHD topk_indices must be [{b}, {sq}, topk], got {tuple(topk_indices.shape)}.")  # error-catalogue: internal: the attention layer passes matching shapes
    low, high = _id_range(topk_indices) if topk_indices.numel() else (-1, -1)
    if low < -1 or high >= n_kv:
        bad = low if low < -1 else high
        raise ValueError(f"sparse attention: key id {bad} is outside the per-batch KV buffer: SBHD ids must be -1 or in [0, {n_kv}).")  # error-catalogue: internal: Megatron's layers build ids inside the buffer
    q_flat = query.permute(1, 0, 2, 3).reshape(b * sq, heads, dim)
    kv_flat = kv_full.permute(1, 0, 2).reshape(b * n_kv, dim)
    offsets = (torch.arange(b, device=topk_indices.device, dtype=topk_indices.dtype) * n_kv).view(b, 1, 1)
    ids = torch.where(topk_indices >= 0, topk_indices + offsets, topk_indices).reshape(b * sq, -1)
    return q_flat, kv_flat, ids, (sq, b)


def _from_flat(out: torch.Tensor, sbhd) -> torch.Tensor:
    rows, heads, dim = out.shape
    if sbhd is None:
        return out.reshape(rows, heads * dim)
    sq, b = sbhd
    return out.reshape(b, sq, heads * dim).permute(1, 0, 2).contiguous()


def linear_sparse_attn(
    query: torch.Tensor,
    kv_full: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Sparse MQA attention with a learnable sink, memory linear in the query rows.

    Megatron-LM ``dev``'s ``unfused_compressed_sparse_attn`` interface: THD ``query [rows, heads, d]``,
    ``kv_full [n_kv, d]``, ``topk_indices [rows, K]`` flat ids into ``kv_full`` -> ``[rows, heads * d]``;
    SBHD ``query [sq, b, heads, d]``, ``kv_full [n_kv, b, d]``, ``topk_indices [b, sq, K]`` per-batch ids
    -> ``[sq, b, heads * d]``. ``-1`` ids are no key. ``attn_sink [heads]``. Scores in float32 (float64
    for float64 inputs); output in the query's dtype. ``chunk_rows``: query rows per chunk (default
    :func:`chunk_rows_for` with :data:`DEFAULT_CHUNK_BYTES`)."""
    q, kv, ids, sbhd = _to_flat(query, kv_full, topk_indices)
    _check_inputs(q, kv, attn_sink, ids)
    rows, heads, dim = q.shape
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(heads, dim, ids.shape[1], q.dtype)
    if int(chunk_rows) < 1:
        raise ValueError(f"sparse attention: chunk_rows must be a positive number of query rows, got {chunk_rows}.")  # error-catalogue: internal: callers pass chunk_rows_for's value or a test's
    out = _LinearSparseAttn.apply(q, kv, attn_sink, ids, float(softmax_scale), int(chunk_rows))
    return _from_flat(out, sbhd)


def sparse_attn_reference(
    query: torch.Tensor,
    kv_full: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """The same math written densely and differentiated by autograd (every row at once, keys gathered by
    advanced indexing, the sink as one more softmax column), evaluated in the inputs' dtype: the
    reference the core is tested against in CI (float64), and quadratic in memory by design."""
    q, kv, ids, sbhd = _to_flat(query, kv_full, topk_indices)
    _check_inputs(q, kv, attn_sink, ids)
    rows, heads, _ = q.shape
    keys = kv[ids.clamp(min=0).long()]  # [rows, K, d]
    logits = torch.einsum("rhd,rkd->rhk", q, keys) * softmax_scale
    logits = logits.masked_fill((ids < 0).unsqueeze(1), float("-inf"))
    sink = attn_sink.reshape(1, heads, 1).to(logits.dtype).expand(rows, heads, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return _from_flat(torch.einsum("rhk,rkd->rhd", probs, keys).to(query.dtype), sbhd)
