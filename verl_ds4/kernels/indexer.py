"""DS4's lightning indexer, row-chunked: top-k scoring and the dense indexer KL loss in memory linear in the rows.

The indexer scores query row ``r`` against compressed key ``k`` as
``I(r, k) = sum_h w[r, h] * ReLU(q[r, h] . key[k])`` (float32), keeps each row's ``topk`` best keys among
those it may see, and, with a dense indexer loss, is trained towards the main attention's distribution over
all visible compressed keys: ``sum_r KL(target_r || softmax_k I(r, k))``.

Megatron-LM ``dev`` computes both over whole ``[rows, heads, keys]`` tensors: its ``fused_qk_topk_naive``
(no CP) builds ``[rows, heads, keys]`` float32 scores at once, and its dense-loss path keeps, per 512-row
chunk, the autograd graph of the chunk's ``[512, heads, keys]`` scores until backward, so the kept bytes
grow as ``rows x keys``: quadratic in a GPU's tokens. Here:

* :func:`chunked_qk_topk`: the same top-k, ``chunk_rows`` query rows at a time (no gradient);
* :func:`chunked_dense_indexer_kl`: the same loss value, with a backward that recomputes each chunk's
  scores, prediction and target instead of keeping them: kept for backward are the inputs only.

The target (the main attention's detached distribution) and the validity of each (row, key) pair are
the caller's (Megatron's own teacher helpers in :mod:`verl_ds4.mcore.sparse_attention_patch`; the CPU
models' in :mod:`verl_ds4.models`), passed as functions of a row range.
"""

from __future__ import annotations

from typing import Callable

import torch

from .sparse_attention import DEFAULT_CHUNK_BYTES

__all__ = ["chunked_qk_topk", "chunked_dense_indexer_kl", "indexer_chunk_rows"]

#: float32's smallest normal number: Megatron clamps target and prediction to it before the logarithms.
_TINY = torch.finfo(torch.float32).tiny


def indexer_chunk_rows(heads: int, keys: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that a chunk's float32 ``[rows, heads, keys]`` scores (three of them live in the
    loss's backward) and ``[rows, keys]`` row tensors stay within ``budget_bytes``."""
    per_row = 4 * (3 * heads * keys + 8 * keys)
    return max(1, int(budget_bytes) // max(per_row, 1))


def chunked_qk_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    index_topk: int,
    mask: torch.Tensor | None = None,
    varlen_starts: torch.Tensor | None = None,
    varlen_ends: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    use_relu: bool = True,
    chunk_rows: int | None = None,
) -> tuple[None, torch.Tensor]:
    """Top-k compressed keys of every query row, computed ``chunk_rows`` rows at a time.

    Megatron-LM ``dev``'s ``fused_qk_topk_naive`` interface: ``q [sq, b, h, d]``, ``k [sk, b, d]``,
    ``weights [sq, b, h]``; either an additive ``mask`` (``[sq, sk]`` or ``[b, sq, sk]``) or row-wise
    bounds ``varlen_starts`` / ``varlen_ends`` ``[sq]`` on ``key_positions`` (``[sk]``, default ``arange``).
    Returns ``(None, topk_indices [b, sq, min(index_topk, sk)])``, ``-1`` where a row has fewer visible
    keys. The scores are not returned (they are the quadratic tensor this function avoids)."""
    if mask is not None and varlen_starts is not None:
        raise ValueError("chunked_qk_topk: pass either mask or varlen_starts/varlen_ends, not both.")  # error-catalogue: internal: Megatron's indexer passes one
    if varlen_starts is not None and varlen_ends is None:
        raise ValueError("chunked_qk_topk: varlen_ends is required with varlen_starts.")  # error-catalogue: internal: Megatron's indexer passes both
    sq, b, heads, _ = q.shape
    sk = k.shape[0]
    width = min(int(index_topk), sk)
    out = torch.full((b, sq, width), -1, dtype=torch.int64, device=q.device)
    if width <= 0 or sq == 0:
        return None, out
    rows = chunk_rows or indexer_chunk_rows(heads, sk)
    k_f = k.float()
    if varlen_starts is not None:
        starts = varlen_starts.to(device=q.device, dtype=torch.int64)
        ends = varlen_ends.to(device=q.device, dtype=torch.int64)
        positions = (torch.arange(sk, device=q.device) if key_positions is None else key_positions.to(q.device)).to(torch.int64)
    for start in range(0, sq, rows):
        end = min(start + rows, sq)
        scores = torch.einsum("sbhd,tbd->sbht", q[start:end].float(), k_f)
        if use_relu:
            scores = torch.relu(scores)
        scores = (scores * weights[start:end].unsqueeze(-1)).sum(dim=2).transpose(0, 1)  # [b, c, sk]
        if varlen_starts is not None:
            visible = (positions.unsqueeze(0) >= starts[start:end].unsqueeze(1)) & (positions.unsqueeze(0) < ends[start:end].unsqueeze(1))
            scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
        elif mask is not None:
            scores = scores + (mask[start:end] if mask.ndim == 2 else mask[:, start:end])
        values, ids = scores.topk(width, dim=-1)
        out[:, start:end] = ids.masked_fill(values == float("-inf"), -1)
    return None, out


def _chunk_prediction(q_i, k_f, w_s, valid, start, end):
    """A chunk's raw head scores ``[c, h, K]`` (before ReLU), its logits ``[c, K]`` and ``row_valid [c, 1]``."""
    raw = torch.einsum("rhd,kd->rhk", q_i[start:end].float(), k_f)
    logits = (torch.relu(raw) * w_s[start:end].unsqueeze(-1)).sum(dim=1).masked_fill(~valid, float("-inf"))
    row_valid = valid.any(dim=-1, keepdim=True)
    return raw, torch.where(row_valid, logits, 0.0), row_valid


class _DenseIndexerKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_i, k_i, weights, scale, valid_fn, target_fn, chunk_rows):
        k_f, w_s = k_i.float(), weights.float() * scale
        total = q_i.new_zeros((), dtype=torch.float32)
        for start in range(0, q_i.shape[0], chunk_rows):
            end = min(start + chunk_rows, q_i.shape[0])
            valid = valid_fn(start, end)
            _, logits, row_valid = _chunk_prediction(q_i, k_f, w_s, valid, start, end)
            predict = (torch.softmax(logits, dim=-1, dtype=torch.float32) * row_valid.float()).clamp(min=_TINY)
            target = (target_fn(valid, start, end) * row_valid.float()).clamp(min=_TINY)
            kl = (target * (torch.log(target) - torch.log(predict))).sum(dim=-1)
            total = total + torch.where(row_valid.squeeze(-1), kl, torch.zeros_like(kl)).sum()
        ctx.save_for_backward(q_i, k_i, weights)
        ctx.scale, ctx.valid_fn, ctx.target_fn, ctx.chunk_rows = scale, valid_fn, target_fn, chunk_rows
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        q_i, k_i, weights = ctx.saved_tensors
        scale, chunk_rows = ctx.scale, ctx.chunk_rows
        k_f, w_s = k_i.float(), weights.float() * scale
        need_q, need_k, need_w = ctx.needs_input_grad[:3]
        grad_q = torch.zeros_like(q_i) if need_q else None
        grad_k = torch.zeros(k_i.shape, dtype=torch.float32, device=k_i.device) if need_k else None
        grad_w = torch.zeros_like(weights) if need_w else None
        g = grad_loss.float()
        for start in range(0, q_i.shape[0], chunk_rows):
            end = min(start + chunk_rows, q_i.shape[0])
            valid = ctx.valid_fn(start, end)
            raw, logits, row_valid = _chunk_prediction(q_i, k_f, w_s, valid, start, end)
            soft = torch.softmax(logits, dim=-1, dtype=torch.float32)
            predict = soft * row_valid.float()
            with torch.no_grad():
                target = (ctx.target_fn(valid, start, end) * row_valid.float()).clamp(min=_TINY)
            # d loss / d predict (the clamp passes where predict >= tiny), through "* row_valid" and softmax
            d_pred = torch.where(row_valid & (predict >= _TINY), -g * target / predict.clamp(min=_TINY), 0.0)
            d_soft = d_pred * row_valid.float()
            d_logits = soft * (d_soft - (soft * d_soft).sum(dim=-1, keepdim=True))
            d_logits = torch.where(row_valid & valid, d_logits, 0.0)  # where(row_valid, .., 0) and masked_fill
            positive = raw > 0
            if need_w:
                grad_w[start:end] = (scale * torch.einsum("rk,rhk->rh", d_logits, torch.relu(raw))).to(weights.dtype)
            d_raw = d_logits.unsqueeze(1) * w_s[start:end].unsqueeze(-1) * positive  # [c, h, K]
            if need_q:
                grad_q[start:end] = torch.einsum("rhk,kd->rhd", d_raw, k_f).to(q_i.dtype)
            if need_k:
                grad_k += torch.einsum("rhk,rhd->kd", d_raw, q_i[start:end].float())
        return grad_q, grad_k.to(k_i.dtype) if need_k else None, grad_w, None, None, None, None


def chunked_dense_indexer_kl(
    q_indexer: torch.Tensor,
    k_indexer: torch.Tensor,
    weights: torch.Tensor,
    weight_scale: float,
    valid_fn: Callable[[int, int], torch.Tensor],
    target_fn: Callable[[torch.Tensor, int, int], torch.Tensor],
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``sum_r KL(target_r || predict_r)`` over query rows, float32, differentiable in ``q_indexer [T, h, d]``,
    ``k_indexer [K, d]`` and ``weights [T, h]``; memory linear in ``T``.

    ``predict_r = softmax_k(sum_h weight_scale * weights[r, h] * ReLU(q_indexer[r, h] . k_indexer[k]))`` over
    the keys ``valid_fn(start, end)`` (``[end - start, K]`` bool) marks; a row with none contributes 0.
    ``target_fn(valid, start, end)`` returns the detached float32 ``[end - start, K]`` target of those rows.
    Both functions are called again,
    chunk by chunk, in backward; they must be deterministic. Target and prediction are clamped to
    float32's smallest normal number before the logarithms (as Megatron-LM ``dev``)."""
    rows = chunk_rows or indexer_chunk_rows(q_indexer.shape[1], k_indexer.shape[0])
    return _DenseIndexerKL.apply(q_indexer, k_indexer, weights, float(weight_scale), valid_fn, target_fn, int(rows))
