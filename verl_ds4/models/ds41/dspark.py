"""The DeepSeek-V4.1 DSpark drafter (checkpoint ``mtp.0..K-1``): K window-only stages drafting blocks.

Training input, per sequence of ``C`` target positions and ``A`` anchors ``a_j`` (each drafts a
block of ``B = dspark_block_size`` tokens): draft rows ``D = A * B`` (an anchor embedding then noise
embeddings per block), the backbone's features of ``dspark_target_layer_ids`` (``[C, L * h]``: the
streams entering each target layer's attention, averaged over the streams, concatenated), positions
``0..C-1`` for the context and ``a_j .. a_j + B - 1`` for block ``j`` (:func:`draft_positions`), and
the visibility :func:`draft_visibility`: a draft row sees the context window ``[a_j - W, a_j)`` of
its anchor (only when the block is kept) and every row of its own block.

Each stage is a V4.1 layer with single-pass mHC around a window-only attention over
``[context keys | draft keys]`` and a score-routed MoE (``dspark_n_routed_experts``, top
``dspark_num_experts_per_tok``, V4's :class:`~verl_ds4.models.ds4.moe.DS4MoE`). Stage 0 first maps
the features to the hidden size, ``main_norm(main_proj(features))``, and later stages read that.
The last stage collapses the streams with its carried ``pre`` and normalises (``final_layernorm``);
its Markov head gives transition logits ``head(embed(previous token))`` (rank ``dspark_markov_rank``)
and its confidence head ``proj([normed | markov embedding])`` one acceptance logit per row. Draft
logits are ``output_layer(normed) + transition`` with the target model's frozen output layer.

Names: ``mtp.layers.<k>.{attn_hc, input_layernorm, self_attention.*, mlp_hc, pre_mlp_layernorm,
mlp.*}`` as a backbone layer's; stage 0 ``main_proj``, ``main_norm``; the last stage
``final_layernorm``, ``markov_head.{embed, head}``, ``confidence_head.proj`` (NeMo: ``mtp.<k>.*``
with ``attn`` / ``ffn`` / ``attn_norm`` / ``ffn_norm`` / ``ffn_hc`` / ``norm``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from verl_ds4 import ds41_facts

from ..ds4.attention import _RMSNorm
from ..ds4.moe import DS4MoE, DS4Router
from .csa2 import DS41Attention
from .hyper_connection import DS41HyperConnection, collapse, initial_carried_pre

__all__ = ["draft_positions", "draft_visibility", "DSparkStage", "DS41DSpark"]


def draft_positions(anchors: torch.Tensor, context: int, block: int) -> torch.Tensor:
    """``[C + A * B]``: ``0..C-1``, then ``a_j .. a_j + B - 1`` per anchor."""
    offsets = torch.arange(block, device=anchors.device)
    return torch.cat([torch.arange(context, device=anchors.device), (anchors.unsqueeze(-1) + offsets).flatten()])


def draft_visibility(anchors: torch.Tensor, keep: torch.Tensor, context: int, block: int, window: int) -> torch.Tensor:
    """Bool ``[A * B, C + A * B]``: the anchor's context window when its block is kept, and the own block."""
    rows = anchors.shape[0] * block
    anchor = anchors.repeat_interleave(block).unsqueeze(1)
    kept = keep.repeat_interleave(block).unsqueeze(1)
    key = torch.arange(context, device=anchors.device).unsqueeze(0)
    in_window = (key < anchor) & (key >= anchor - window) & kept
    row_block = torch.arange(rows, device=anchors.device).unsqueeze(1) // block
    own = row_block == torch.arange(rows, device=anchors.device).unsqueeze(0) // block
    return torch.cat([in_window, own], dim=1)


class DSparkStage(nn.Module):
    def __init__(self, text: Any, stage: int, dtype=None, cache_qdq: bool = False):
        super().__init__()
        get = lambda key: ds41_facts.text_value(text, key)  # noqa: E731
        h, n, eps = int(get("hidden_size")), int(get("hc_mult")), float(get("rms_norm_eps"))
        iters, hc_eps = int(get("hc_sinkhorn_iters")), float(get("hc_eps"))
        layer, stages = int(get("num_hidden_layers")) + stage, int(get("num_nextn_predict_layers"))
        self.attn_hc = DS41HyperConnection(h, n, iters, hc_eps, eps, dtype=dtype)
        self.input_layernorm = _RMSNorm(h, eps, dtype=dtype)
        role = ds41_facts.LayerRole(layer, 0, ds41_facts.WINDOW)
        self.self_attention = DS41Attention(text, layer, dtype=dtype, cache_qdq=cache_qdq, role=role)
        self.mlp_hc = DS41HyperConnection(h, n, iters, hc_eps, eps, dtype=dtype)
        self.pre_mlp_layernorm = _RMSNorm(h, eps, dtype=dtype)
        router = DS4Router(
            h, int(get("dspark_n_routed_experts")), int(get("dspark_num_experts_per_tok")),
            str(get("scoring_func") or "sqrtsoftplus"), bool(get("norm_topk_prob") if get("norm_topk_prob") is not None else True),
            float(get("routed_scaling_factor")), dtype=dtype,
        )  # fmt: skip
        inter = int(get("moe_intermediate_size"))
        self.mlp = DS4MoE(h, router, inter, inter * int(get("n_shared_experts") or 1), get("swiglu_limit"), dtype=dtype)
        if stage == 0:
            self.main_proj = nn.Linear(h * len(get("dspark_target_layer_ids")), h, bias=False, dtype=dtype)
            self.main_norm = _RMSNorm(h, eps, dtype=dtype)
        if stage == stages - 1:
            rank, vocab = int(get("dspark_markov_rank")), int(get("vocab_size"))
            self.final_layernorm = _RMSNorm(h, eps, dtype=dtype)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(vocab, rank, dtype=dtype)
            self.markov_head.head = nn.Linear(rank, vocab, bias=False, dtype=dtype)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(h + rank, 1, bias=False, dtype=dtype)

    def forward(self, streams, carried, context, positions, visible):
        if hasattr(self, "main_proj"):
            context = self.main_norm(self.main_proj(context))

        def attention(y):
            return self.self_attention.attend_context(self.input_layernorm(y), context, positions, visible)

        streams, carried = self.attn_hc(streams, carried, attention)
        streams, carried = self.mlp_hc(streams, carried, lambda y: self.mlp(self.pre_mlp_layernorm(y)))
        return streams, carried, context


class DS41DSpark(nn.Module):
    """The drafter's stages (``mtp.layers``); see the module doc."""

    def __init__(self, text: Any, dtype=None, cache_qdq: bool = False, device=None):
        super().__init__()
        if not ds41_facts.has_dspark(text):
            raise ValueError("this V4.1 config has no DSpark drafter (num_nextn_predict_layers > 0 with dspark_* keys).")
        stages = int(ds41_facts.text_value(text, "num_nextn_predict_layers"))
        self.hc_mult = int(ds41_facts.text_value(text, "hc_mult"))
        self.mtp = nn.Module()
        with torch.device(device) if device is not None else contextlib.nullcontext():  # every tensor on ``device``
            self.mtp.layers = nn.ModuleList(DSparkStage(text, k, dtype=dtype, cache_qdq=cache_qdq) for k in range(stages))

    def forward(self, noise: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                previous_ids: torch.Tensor | None = None, confidence: bool = True,
                confidence_stop_gradient: bool = False):  # fmt: skip
        """``noise`` ``[D, h]``, ``features`` ``[C, L * h]``, ``positions`` ``[C + D]``, ``visible``
        ``[D, C + D]``, ``previous_ids`` ``[D]`` -> ``(normed [D, h], transition logits [D, V] or None,
        confidence logits [D] or None)``. ``confidence=False`` skips the confidence head;
        ``confidence_stop_gradient``: it reads detached inputs (its loss trains only ``confidence_head``)."""
        streams = noise.unsqueeze(-2).expand(noise.shape[0], self.hc_mult, noise.shape[-1])
        carried = initial_carried_pre(noise.shape[:1], self.hc_mult, dtype=noise.dtype, device=noise.device)
        context = features
        for stage in self.mtp.layers:
            streams, carried, context = stage(streams, carried, context, positions, visible)
        last = self.mtp.layers[-1]
        normed = last.final_layernorm(collapse(streams, carried))
        if previous_ids is None:
            return normed, None, None
        markov = last.markov_head.embed(previous_ids)
        score = None
        if confidence:
            inputs = torch.cat([normed, markov], dim=-1)
            score = last.confidence_head.proj(inputs.detach() if confidence_stop_gradient else inputs).squeeze(-1)
        return normed, last.markov_head.head(markov), score
