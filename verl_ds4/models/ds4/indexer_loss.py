"""The lightning indexer's auxiliary KL loss (Megatron-LM dev's dense ``dsa_indexer_loss`` for CSA).

For each query row ``i`` and the compressed blocks ``B_i`` it may see (same sequence, completed:
``b < (pos_i + 1) // 4``; *all* of them, not only the top-k: dev's default dense loss,
``dsa_indexer_use_sparse_loss=False``)::

    z_h(b)   = q_h . c_b / sqrt(d)                                  # main attention logits, detached
    Z_h      = logsumexp(window logits_h) (+) sink_h (+) logsumexp_{b in B_i} z_h(b)
    p_h(b)   = exp(z_h(b) - Z_h)                                    # the main attention's mass on block b
    t(b)     = sum_h p_h(b) / sum_{b'} sum_h p_h(b')                 # teacher over B_i
    s(b)     = softmax_{b in B_i}(I(i, b))                           # the indexer's scores
    KL_i     = sum_b t(b) * (log t(b) - log s(b))                    # both clamped at float32 tiny
    loss     = dsa_indexer_loss_coeff * sum_i KL_i / (real tokens of the micro-batch)

``(+)`` is log-add-exp: the window and the sink take their share of each head's softmax, so a
head that mostly attends its window weighs little in the teacher (dev's
``_compute_unfused_csa_non_compressed_lse`` + ``_compute_indexer_teacher_probabilities`` +
``_normalize_indexer_teacher_target``). Rows with no visible block contribute 0.

Queries and divisor are the *real* tokens (the attention gets their lengths from the micro-batch's
plan, ``PlannedPackedSeqParams.plan``), summed over the whole CP group, so the per-rank shares sum to
the CP = 1 loss. This is where we differ from dev: dev divides by the packed rows
(``l_local * cp_size``, padding included, since verl's ``cu_seqlens_q`` is the padded one) and
counts padding rows as queries (a padding row sees the real blocks before it), so dev's loss moves
with the CP padding (cp_size * 128-row minimum, divisibility padding); with no padding the two agree.

Only the indexer is trained by it: the teacher is detached, and the indexer already reads detached
hidden rows and a detached compressed query (its compressor, ``linear_wq_b`` and ``linear_weights_proj``
get the gradient; nothing else does).
"""

from __future__ import annotations

import torch

__all__ = ["indexer_kl_sum", "indexer_loss_report"]

_TINY = torch.finfo(torch.float32).tiny  # dev's clamp, at every precision


def indexer_kl_sum(q, comp, window_logits, sink, valid, index_scores, scale: float) -> torch.Tensor:
    """``sum_i KL_i`` of this rank's query rows.

    q ``[T, n, d]`` (rotated queries), comp ``[NB, d]`` (compressed KV), window_logits ``[T, n, W]``
    (scaled, ``-inf`` where not visible), sink ``[n]``, valid ``[T, NB]`` bool, index_scores ``[T, NB]``
    (the indexer's ``I``; the only input with a gradient), scale = ``1 / sqrt(d)``.
    """
    q, comp, window_logits, sink = q.detach(), comp.detach(), window_logits.detach(), sink.detach()
    window_sink_lse = torch.logaddexp(torch.logsumexp(window_logits, dim=-1), sink.view(1, -1))  # [T, n]
    comp_logits = (torch.einsum("tnd,bd->tnb", q, comp) * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
    full_lse = torch.logaddexp(window_sink_lse, torch.logsumexp(comp_logits, dim=-1))
    teacher = torch.exp(comp_logits - full_lse.unsqueeze(-1)).sum(dim=1)  # [T, NB]; 0 where not valid
    teacher = teacher / teacher.sum(dim=-1, keepdim=True).clamp_min(_TINY)
    row_valid = valid.any(dim=-1, keepdim=True)
    student_logits = torch.where(row_valid, index_scores.masked_fill(~valid, float("-inf")), 0.0)
    student = torch.softmax(student_logits, dim=-1) * row_valid
    teacher, student = teacher.clamp(min=_TINY), student.clamp(min=_TINY)
    kl = (teacher * (teacher.log() - student.log())).sum(dim=-1)
    return torch.where(row_valid.squeeze(-1), kl, torch.zeros_like(kl)).sum()


def indexer_loss_report(model) -> float | None:
    """Sum over the model's CSA layers of the last forward's indexer loss (global over CP, already
    times ``dsa_indexer_loss_coeff``); ``None`` when no layer computed one (coefficient 0, eval mode
    or no autograd)."""
    values = [m.last_indexer_loss for m in model.modules() if getattr(m, "last_indexer_loss", None) is not None]
    return float(sum(values)) if values else None
