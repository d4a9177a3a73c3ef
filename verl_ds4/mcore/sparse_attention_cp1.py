"""The CSA indexer's top-k and loss without CP, row-chunked: a replacement of Megatron-LM ``dev``'s
``dsa.FusedDSAIndexerLoss`` as ``csa.py`` calls it (``csa.FusedDSAIndexerLoss.apply``) in its CP 1 THD path.

Megatron's function scores every query row against every compressed key at once: the indexer's
``[T, n_I, K]`` scores and the main attention's ``[n_h, T, K]`` teacher logits (``K = T / 4``), quadratic in a
GPU's tokens; its backward recomputes the same whole tensors. Here the top-k comes from
:func:`verl_ds4.kernels.chunked_qk_topk`, and the loss is summed over chunks of query rows, each chunk computed
with Megatron's own helpers (teacher probabilities, their normalisation, the masked log-softmax, the KL per row),
so the numbers are Megatron's; the backward recomputes one chunk at a time under autograd. Kept for backward:
the inputs. The largest transient: one chunk's ``[n_h, rows, K]`` logits.

Only the packed THD call with row-wise bounds (``varlen_starts`` / ``varlen_ends``, no additive ``mask``, batch 1)
is chunked; any other call goes to Megatron's own function unchanged.
"""

from __future__ import annotations

import importlib

import torch

from verl_ds4.kernels import chunked_qk_topk, indexer_chunk_rows

__all__ = ["FORWARD_PARAMETERS", "chunked_indexer_loss"]

#: ``dsa.FusedDSAIndexerLoss.forward``'s parameters after ``ctx`` at the proven commits.
FORWARD_PARAMETERS = (
    "q", "weights", "k", "query", "key", "softmax_scale", "topk", "loss_coeff", "mask", "sparse_loss", "pg_collection",
    "varlen_starts", "varlen_ends", "key_positions", "query_valid_rows", "calculate_per_token_loss", "use_relu",
    "non_compressed_lse",
)  # fmt: skip


class _Helpers:
    """Megatron's own pieces of the loss, from the package of its ``csa`` module."""

    def __init__(self, csa):
        package = csa.__name__.rsplit(".", 1)[0]
        self.teacher = csa._compute_indexer_teacher_probabilities
        self.normalize = csa._normalize_indexer_teacher_target
        self.masking = importlib.import_module(package + ".dsa_masking")
        self.kl = importlib.import_module(package + ".dsa_indexer_loss")


def _chunk_kl(h: _Helpers, spec: dict, q, weights, k, start: int, end: int) -> torch.Tensor:
    """Sum over query rows ``start:end`` of the KL per row (``q`` / ``weights`` are those rows, ``k`` all keys)."""
    index = torch.einsum("sbhd,tbd->sbht", q.float(), k.float())
    if spec["use_relu"]:
        index = torch.relu(index)
    index = (index * weights.unsqueeze(-1)).sum(dim=2).transpose(0, 1)  # [1, c, K]
    key = spec["key"]  # float32, [K, d] (one key for every head: Megatron's CP 1 call expands it) or [K, h, d]
    pattern = "snd,kd->nsk" if key.ndim == 2 else "snd,knd->nsk"
    attn = torch.einsum(pattern, spec["query"][start:end].float(), key) * spec["scale"]
    attn = attn.unsqueeze(0)  # [1, n_h, c, K]
    positions = spec["positions"]
    valid = (positions.unsqueeze(0) >= spec["starts"][start:end].unsqueeze(1)) & (positions.unsqueeze(0) < spec["ends"][start:end].unsqueeze(1))
    attn = attn.masked_fill(~valid.view(1, 1, *valid.shape), float("-inf"))
    index = index.masked_fill(~valid.unsqueeze(0), float("-inf"))
    base_valid = valid.unsqueeze(0)
    index_mask = torch.full(index.shape, float("-inf"), dtype=torch.float32, device=index.device)
    h.masking.scatter_topk_into_index_mask(index_mask, spec["topk"][:, start:end], seq_chunk_size=256)
    if spec["sparse_loss"]:
        attn = attn + index_mask.unsqueeze(1)
        index = index + index_mask
        index_valid = base_valid & (index_mask == 0)
    else:
        index_valid = base_valid
    lse = spec["lse"][:, :, start:end] if spec["lse"] is not None else None
    probs = h.teacher(attn, index_valid if spec["sparse_loss"] else base_valid, non_compressed_lse=lse)
    log_scores = h.masking.masked_log_softmax(index.float(), index_valid, dim=-1)
    target = probs.sum(dim=1)
    group = spec["tp_group"]
    if group is not None:
        torch.distributed.all_reduce(target.contiguous(), group=group)
    target = h.normalize(target, lse)
    rows = h.kl.indexer_kl_per_row(target, log_scores)  # [1, c]
    if spec["valid_rows"] is not None:
        rows = rows * spec["valid_rows"][:, start:end].float()
    return rows.sum()


def _teacher_keys(key: torch.Tensor) -> torch.Tensor:
    """The teacher's keys in float32, once per call: ``[K, d]`` when ``key [K, h, d]`` repeats one key over the
    heads (a stride-0 expand, as Megatron passes the compressed KV), else ``[K, h, d]``."""
    return (key[:, 0] if key.shape[1] > 1 and key.stride(1) == 0 else key).detach().float()


class _ChunkedIndexerLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, weights, k, helpers, spec, factor, chunk_rows):
        total = q.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, q.shape[0], chunk_rows):
                end = min(start + chunk_rows, q.shape[0])
                total = total + _chunk_kl(helpers, spec, q[start:end], weights[start:end], k, start, end)
        ctx.save_for_backward(q, weights, k)
        ctx.helpers, ctx.spec, ctx.factor, ctx.chunk_rows = helpers, spec, factor, chunk_rows
        return total * factor

    @staticmethod
    def backward(ctx, grad_loss):
        q, weights, k = ctx.saved_tensors
        grad_q, grad_w = torch.zeros_like(q), torch.zeros_like(weights)
        k_leaf = k.detach().requires_grad_(True)
        for start in range(0, q.shape[0], ctx.chunk_rows):
            end = min(start + ctx.chunk_rows, q.shape[0])
            q_c = q[start:end].detach().requires_grad_(True)
            w_c = weights[start:end].detach().requires_grad_(True)
            with torch.enable_grad():
                part = _chunk_kl(ctx.helpers, ctx.spec, q_c, w_c, k_leaf, start, end) * (ctx.factor * grad_loss)
                torch.autograd.backward(part, inputs=[q_c, w_c, k_leaf])
            grad_q[start:end] = q_c.grad
            grad_w[start:end] = w_c.grad
        grad_k = k_leaf.grad if k_leaf.grad is not None else torch.zeros_like(k)
        return grad_q, grad_w, grad_k, None, None, None, None


def chunked_indexer_loss(csa, original, chunk_rows: int | None = None):
    """An object with ``apply(...)`` taking ``dsa.FusedDSAIndexerLoss.forward``'s arguments, returning
    ``(topk_indices [1, T, topk], loss)``: chunked for the packed THD call, ``original.apply`` otherwise.
    ``chunk_rows``: query rows per chunk (default: :func:`verl_ds4.kernels.indexer_chunk_rows`'s budget)."""
    helpers = _Helpers(csa)

    class ChunkedFusedDSAIndexerLoss:
        @staticmethod
        def apply(q, weights, k, query, key, softmax_scale, topk, loss_coeff, mask, sparse_loss, pg_collection,
                  varlen_starts=None, varlen_ends=None, key_positions=None, query_valid_rows=None,
                  calculate_per_token_loss=False, use_relu=True, non_compressed_lse=None):  # fmt: skip
            args = (q, weights, k, query, key, softmax_scale, topk, loss_coeff, mask, sparse_loss, pg_collection, varlen_starts,
                    varlen_ends, key_positions, query_valid_rows, calculate_per_token_loss, use_relu, non_compressed_lse)  # fmt: skip
            packed = mask is None and varlen_starts is not None and q.ndim == 4 and q.shape[1] == 1 and query.ndim == 3 and key.ndim == 3
            if not packed:
                return original.apply(*args)
            _, ids = chunked_qk_topk(q, k, weights, topk, None, varlen_starts, varlen_ends, key_positions, use_relu)
            sk = k.shape[0]
            positions = torch.arange(sk, device=q.device) if key_positions is None else key_positions.to(q.device, torch.int64)
            valid_rows = helpers.masking.normalize_query_valid_rows(query_valid_rows, b=1, sq=q.shape[0], device=q.device)
            tp = getattr(pg_collection, "tp", None)
            spec = {
                "query": query, "key": _teacher_keys(key), "scale": float(softmax_scale), "sparse_loss": bool(sparse_loss), "topk": ids,
                "starts": varlen_starts.to(q.device, torch.int64), "ends": varlen_ends.to(q.device, torch.int64),
                "positions": positions, "lse": non_compressed_lse, "valid_rows": valid_rows, "use_relu": bool(use_relu),
                "tp_group": tp if tp is not None and tp.size() > 1 else None,
            }  # fmt: skip
            if calculate_per_token_loss:
                factor = float(loss_coeff)
            elif valid_rows is not None:
                factor = float(loss_coeff) / max(float(valid_rows.float().sum()), 1.0)
            else:
                factor = float(loss_coeff) / max(q.shape[0], 1)
            rows = chunk_rows or indexer_chunk_rows(max(query.shape[1], q.shape[2]), max(sk, 1))
            loss = _ChunkedIndexerLoss.apply(q, weights, k, helpers, spec, factor, rows)
            return ids, loss

    ChunkedFusedDSAIndexerLoss.__name__ = ChunkedFusedDSAIndexerLoss.__qualname__ = "ChunkedFusedDSAIndexerLoss"
    return ChunkedFusedDSAIndexerLoss

