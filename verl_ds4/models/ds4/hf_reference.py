"""Run transformers' ``DeepseekV4Attention`` as a reference for :class:`DS4HybridAttention`.

Inherent differences to know about when comparing the two:

1. **Precision.** transformers computes several steps in float32 whatever the model dtype: the
   weighted RMSNorm (``hidden_states.to(torch.float32)``), the rotary tables (``.float()``), the
   rotation itself (``rope.float() * cos``), the compressor softmax (``dtype=torch.float32``) and
   the indexer scores. An fp64 copy of it is therefore only fp32-accurate (about 1e-7 relative).
   :class:`~verl_ds4.substitutes.precision.PromoteFloat32ToFloat64` is a ``TorchFunctionMode`` that turns every float32 request
   made inside it into float64 without touching the reference's code, which makes the reference a
   true fp64 computation for a 1e-10 comparison.
2. **Top-k ties.** ``torch.topk`` leaves the order of equal scores unspecified; our indexer takes
   equal scores in block order. Selections can differ only for queries whose k-th and (k+1)-th
   best visible indexer scores are equal (ReLU makes exact zeros likely when few indexer heads are
   used); :func:`unambiguous_topk_queries` finds the queries where the selection is well defined.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_ds4.substitutes.precision import PromoteFloat32ToFloat64, StableTopK, fp64_reference

__all__ = [
    "PromoteFloat32ToFloat64",
    "StableTopK",
    "fp64_reference",
    "hf_attention_forward",
    "hf_indexer_scores",
    "hf_model_logits",
    "unambiguous_topk_queries",
]


def _sliding_causal_mask(n: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, n, n] mask: key j visible to query i iff i - window < j <= i."""
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    visible = (j <= i) & (j > i - window)
    return torch.zeros(n, n, dtype=dtype).masked_fill(~visible, float("-inf")).view(1, 1, n, n)


def hf_attention_forward(attn: Any, rotary: Any, x: torch.Tensor) -> torch.Tensor:
    """One sequence ``x`` [N, h] through a transformers ``DeepseekV4Attention`` (no cache) -> [N, h]."""
    n = x.shape[0]
    position_ids = torch.arange(n).unsqueeze(0)
    hidden = x.unsqueeze(0)
    embeddings = {label: rotary(hidden, position_ids=position_ids, layer_type=label) for label in ("main", "compress")}
    mask = _sliding_causal_mask(n, attn.sliding_window, x.dtype)
    out, _ = attn(hidden, position_embeddings=embeddings, position_ids=position_ids, attention_mask=mask, past_key_values=None)
    return out[0]


def hf_indexer_scores(attn: Any, x: torch.Tensor) -> torch.Tensor:
    """The CSA indexer's masked scores [N, NB] for one sequence (``-inf`` where a block is not yet complete)."""
    indexer = attn.compressor.indexer
    captured = {}

    def grab(module, inputs, output):
        captured["scores"] = output

    handle = indexer.scorer.register_forward_hook(grab)
    try:
        hf_attention_forward(attn, indexer.rotary_emb, x)
    finally:
        handle.remove()
    scores = captured["scores"][0]
    n, nb = scores.shape
    ratio = indexer.compress_rate
    future = torch.arange(nb).unsqueeze(0) >= ((torch.arange(n) + 1) // ratio).unsqueeze(1)
    return scores.masked_fill(future, float("-inf"))


def unambiguous_topk_queries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [N]: the top-k set of visible (finite) scores is unique (no tie across the k-th place)."""
    finite = torch.isfinite(scores)
    n_visible = finite.sum(dim=1)
    ordered = torch.sort(scores, dim=1, descending=True).values
    if ordered.shape[1] <= k:
        return torch.ones(scores.shape[0], dtype=torch.bool)
    kth, next_ = ordered[:, k - 1], ordered[:, k]
    return (n_visible <= k) | (kth != next_)


def hf_model_logits(hf_model: Any, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sequence logits ``[L_i, vocab]`` of a transformers ``DeepseekV4ForCausalLM`` (one sequence per
    forward, no cache). Run it inside :func:`fp64_reference` for an fp64 reference."""
    out = []
    with torch.no_grad():
        for ids in sequences:
            out.append(hf_model(input_ids=ids.view(1, -1), use_cache=False).logits[0])
    return out
