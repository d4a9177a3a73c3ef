"""Per-token log-probs and entropy straight from the LM head's input, in row chunks (memory linear in T).

:func:`chunked_linear_logprobs` has the signature and the numbers of verl 0.9.1's Triton
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (the kernel verl's fused Megatron
forward calls by name): ``(hidden [.., H], weight [V_local, H], labels [..], temperature: float,
reduction="none", group) -> (log_probs [N], entropy [N])`` in float32 (float64 for float64 inputs),
``log_probs[i] = log softmax(h_i W^T / t)[label_i]`` and ``entropy[i]`` of the same distribution.

It never holds the ``[T, V]`` logits: the rows are processed ``chunk_rows`` at a time (default: what
:data:`~.sparse_attention.DEFAULT_CHUNK_BYTES` of one chunk's logits allow), and the backward
recomputes each chunk's logits from the saved ``hidden`` / ``weight`` and the per-row log-sum-exp
and entropy (flash-style). What it keeps between forward and backward is ``8-16`` bytes per token
(log-sum-exp and entropy, the outputs); its work space is a few ``[chunk_rows, V_local]`` blocks.

Tensor parallel (``group`` with more than one rank): ``weight`` holds this rank's vocabulary rows
``[rank * V_local, (rank + 1) * V_local)``; each chunk's max, sum of exponentials, label logit and
``sum p z`` are all-reduced over the group. As in verl's kernel, the gradient of ``hidden`` is this
rank's part (Megatron's tensor-parallel region sums it) and that of ``weight`` its own rows.

Why it exists: verl's kernel is Triton (no CPU), so the CPU tests run verl's fused path with this one
in its place. It is also the building block of a chunked loss for the passes verl does not give its
fused kernel (SFT with MTP); that loss is not wired yet: verl's engine has no hook for the head's loss
beside Megatron's MTP (docs/memory.md, "The logits").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .sparse_attention import DEFAULT_CHUNK_BYTES

__all__ = ["chunked_linear_logprobs", "logprobs_chunk_rows"]


def logprobs_chunk_rows(vocab_local: int, dtype: torch.dtype, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's logits ``[rows, V_local]`` in ``dtype`` take at most ``budget_bytes``."""
    if vocab_local < 1 or budget_bytes < 1:
        raise ValueError(f"vocab_local ({vocab_local}) and budget_bytes ({budget_bytes}) must be positive.")
    return max(1, budget_bytes // (vocab_local * torch.empty((), dtype=dtype).element_size()))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tp(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _tp(group)[1] > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _chunk_logits(hidden, weight, rows: slice, temperature: float, dtype) -> torch.Tensor:
    return (hidden[rows].to(dtype) @ weight.to(dtype).t()).div_(temperature)


def _local_labels(labels: torch.Tensor, vocab_local: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's column of each label, clamped, and whether the label is in this rank's rows."""
    rank, _ = _tp(group)
    local = labels - rank * vocab_local
    mine = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), mine


class _ChunkedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_rows, group):
        dtype = _compute_dtype(hidden.dtype)
        rows_total, vocab_local = hidden.shape[0], weight.shape[0]
        local, mine = _local_labels(labels, vocab_local, group)
        lse = torch.empty(rows_total, dtype=dtype, device=hidden.device)
        entropy = torch.empty_like(lse)
        log_probs = torch.empty_like(lse)
        for start in range(0, rows_total, chunk_rows):
            rows = slice(start, min(start + chunk_rows, rows_total))
            z = _chunk_logits(hidden, weight, rows, temperature, dtype)
            peak = _all_reduce(z.amax(dim=1), group, dist.ReduceOp.MAX)
            z.sub_(peak.unsqueeze(1))  # z - max: every statistic below is shifted by the same max
            e = z.exp()
            stats = torch.stack(
                [e.sum(1), (e * z).sum(1), torch.where(mine[rows], z.gather(1, local[rows, None]).squeeze(1), 0)]
            )
            sum_e, sum_ez, label_z = _all_reduce(stats, group)
            log_sum = sum_e.log()
            lse[rows] = log_sum + peak
            log_probs[rows] = label_z - log_sum
            entropy[rows] = log_sum - sum_ez / sum_e
            del z, e
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk_rows, ctx.group = temperature, chunk_rows, group
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        temperature, chunk_rows, group = ctx.temperature, ctx.chunk_rows, ctx.group
        dtype = lse.dtype
        rows_total, vocab_local = hidden.shape[0], weight.shape[0]
        local, mine = _local_labels(labels, vocab_local, group)
        g_lp = torch.zeros_like(lse) if grad_log_probs is None else grad_log_probs.to(dtype)
        g_h = torch.zeros_like(lse) if grad_entropy is None else grad_entropy.to(dtype)
        mean_z = lse - entropy  # sum_j p_j z_j
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        w = weight.to(dtype)
        for start in range(0, rows_total, chunk_rows):
            rows = slice(start, min(start + chunk_rows, rows_total))
            z = _chunk_logits(hidden, weight, rows, temperature, dtype)
            p = (z - lse[rows, None]).exp_()
            # d log p_label / dz = onehot - p;  d entropy / dz = -p (z - sum p z)
            dz = z.sub_(mean_z[rows, None]).mul_(p).mul_(-g_h[rows, None])
            dz.sub_(p.mul_(g_lp[rows, None]))
            picked = torch.where(mine[rows], g_lp[rows], 0)
            dz.scatter_add_(1, local[rows, None], picked[:, None])
            dz.div_(temperature)
            grad_hidden[rows] = dz @ w
            grad_weight.addmm_(dz.t(), hidden[rows].to(dtype))
            del z, p, dz
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None


def chunked_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
    *,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs [N], entropy [N])`` of ``softmax(hidden W^T / temperature)``, ``N`` = rows of ``hidden``
    (its leading dimensions flattened); verl's ``linear_cross_entropy`` arguments, ``reduction="none"`` only."""
    if reduction != "none":
        raise ValueError(f"chunked_linear_logprobs supports reduction='none' only (per-token values), got {reduction!r}.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"temperature must be a positive float, got {temperature!r}.")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden [.., {hidden.shape[-1]}] and weight {tuple(weight.shape)} disagree on the hidden size.")
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_labels.numel() != flat.shape[0]:
        raise ValueError(f"{flat_labels.numel()} labels for {flat.shape[0]} hidden rows; expected one label per row.")
    rows = chunk_rows or logprobs_chunk_rows(weight.shape[0], _compute_dtype(hidden.dtype))
    if rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}.")
    return _ChunkedLinearLogProbs.apply(flat, weight, flat_labels, float(temperature), int(rows), dist_process_group)
