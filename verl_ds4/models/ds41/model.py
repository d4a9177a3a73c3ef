"""The DeepSeek-V4.1 text backbone in pure PyTorch: embedding, layers, single-pass mHC collapse, norm, head.

One layer (``decoder.layers.<i>``), on the residual streams ``x [T, n, h]`` of this rank's packed rows::

    x = engram(x)                                        # Engram layers only (before the attention site)
    x, carried = attn_hc(x, carried, lambda y: self_attention(input_layernorm(y)))
    x, carried = mlp_hc(x, carried, lambda y: mlp(pre_mlp_layernorm(y)))

The embedding is replicated into the ``n`` streams and the first carried ``pre`` selects stream 0;
after the last layer the streams collapse with the last carried ``pre`` (no ``hc_head``), then
``decoder.final_layernorm`` and ``output_layer``. The CSA2 state passes from layer to layer
(:mod:`.csa2`); the Engram rows are hashed once per forward from this rank's token ids (and, under
CP, the previous rank's last ones). The MoE is V4's :class:`~verl_ds4.models.ds4.moe.DS4MoE` with a
score router (``sqrtsoftplus``, the correction bias for the choice only; V4.1 has no hash layers), a
shared expert and the SwiGLU clamp. Names follow Megatron-Core's ``GPTModel`` / V4's ``DS4Model``
(``embedding.word_embeddings``, ``decoder.layers.<i>.{input_layernorm, self_attention, attn_hc,
pre_mlp_layernorm, mlp, mlp_hc, engram}``, ``decoder.final_layernorm``, ``output_layer``); the
Megatron-Core wrapper itself is a later step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl_ds4 import ds41_facts

from ..ds4.attention import _RMSNorm
from ..ds4.moe import DS4MoE, DS4Router
from .csa2 import CSA2State, DS41Attention, _row_positions
from .engram import DS41Engram, EngramHasher
from .hyper_connection import DS41HyperConnection, collapse, initial_carried_pre

__all__ = ["DS41Layer", "DS41Model", "run_decoder"]


class DS41Layer(nn.Module):
    def __init__(self, text: Any, layer: int, dtype=None, cache_qdq: bool = False):
        super().__init__()
        get = lambda key: ds41_facts.text_value(text, key)  # noqa: E731
        h, n, eps = int(get("hidden_size")), int(get("hc_mult")), float(get("rms_norm_eps"))
        iters, hc_eps = int(get("hc_sinkhorn_iters")), float(get("hc_eps"))
        self.layer = layer
        self.layer_number = layer + 1  # Megatron's 1-based numbering (verl's router replay addresses routers by it)
        self.engram = DS41Engram.from_config(text, layer, dtype=dtype) if layer in (get("engram_layer_ids") or []) else None
        self.attn_hc = DS41HyperConnection(h, n, iters, hc_eps, eps, dtype=dtype)
        self.input_layernorm = _RMSNorm(h, eps, dtype=dtype)
        self.self_attention = DS41Attention(text, layer, dtype=dtype, cache_qdq=cache_qdq)
        self.mlp_hc = DS41HyperConnection(h, n, iters, hc_eps, eps, dtype=dtype)
        self.pre_mlp_layernorm = _RMSNorm(h, eps, dtype=dtype)
        router = DS4Router(
            h, int(get("n_routed_experts")), int(get("num_experts_per_tok")), str(get("scoring_func") or "sqrtsoftplus"),
            bool(get("norm_topk_prob") if get("norm_topk_prob") is not None else True),
            float(get("routed_scaling_factor")), dtype=dtype,
        )  # fmt: skip
        inter = int(get("moe_intermediate_size"))
        self.mlp = DS4MoE(h, router, inter, inter * int(get("n_shared_experts") or 1), get("swiglu_limit"), dtype=dtype)

    def forward(self, streams, carried, state: CSA2State, engram_rows=None, cu_seqlens_padded=None, cp_group=None):
        if self.engram is not None:
            streams = self.engram(streams, engram_rows)
        out: dict[str, CSA2State] = {}

        def attention(y):
            result, out["state"] = self.self_attention(self.input_layernorm(y), state, cu_seqlens_padded, cp_group)
            return result

        streams, carried = self.attn_hc(streams, carried, attention)
        streams, carried = self.mlp_hc(streams, carried, lambda y: self.mlp(self.pre_mlp_layernorm(y)))
        return streams, carried, out["state"]


class DS41Model(nn.Module):
    """The V4.1 backbone and LM head of a ``config.json`` (dict or text config); ``token_map``: the
    Engram normalisation table (:func:`~.engram.engram_token_map`), required when Engram layers exist;
    ``cache_qdq``: the released cache rounding in every attention (:mod:`.cache_qdq`)."""

    def __init__(self, text: Any, token_map: list[int] | None = None, dtype=None, cache_qdq: bool = False, device=None):
        super().__init__()
        with torch.device(device) if device is not None else contextlib.nullcontext():  # every tensor on ``device``
            self._build(text, token_map, dtype, cache_qdq)

    def _build(self, text, token_map, dtype, cache_qdq: bool) -> None:
        nested = ds41_facts.text_config(text) is not text or "model_type" in text
        self.facts = ds41_facts.read_config(text if nested else {"model_type": ds41_facts.HF_MODEL_TYPE, "text_config": text})
        get = lambda key: ds41_facts.text_value(text, key)  # noqa: E731
        h, vocab = int(get("hidden_size")), int(get("vocab_size"))
        self.hc_mult = int(get("hc_mult"))
        if self.facts.engram_layers and token_map is None:
            raise ValueError(
                f"Engram layers {list(self.facts.engram_layers)} need the tokenizer-normalisation table: pass "
                "token_map=engram_token_map(tokenizer)[0] with the checkpoint's tokenizer."
            )
        self.engram_hasher = EngramHasher(text, token_map) if self.facts.engram_layers else None
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, h, dtype=dtype)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(DS41Layer(text, i, dtype=dtype, cache_qdq=cache_qdq) for i in range(self.facts.num_layers))
        self.decoder.final_layernorm = _RMSNorm(h, float(get("rms_norm_eps")), dtype=dtype)
        self.output_layer = nn.Linear(h, vocab, bias=False, dtype=dtype)

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None, cp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """``input_ids`` ``[T]``: this rank's packed rows -> logits ``[T, vocab]``."""
        hidden = run_decoder(self.decoder.layers, self.engram_hasher, self.facts, self.embedding.word_embeddings(input_ids),
                             input_ids, cu_seqlens_padded, cp_group)  # fmt: skip
        return self.output_layer(self.decoder.final_layernorm(hidden))


def run_decoder(layers, engram_hasher, facts, embedded: torch.Tensor, input_ids: torch.Tensor, cu_seqlens_padded=None,
                cp_group=None) -> torch.Tensor:  # fmt: skip
    """``layers`` (:class:`DS41Layer`) with the Engram hasher on this rank's embedded rows ``[T, h]`` and
    their token ids ``[T]`` -> the collapsed streams ``[T, h]`` (before the final norm)."""
    rows, hc_mult = input_ids.shape[0], layers[0].attn_hc.n
    streams = embedded.unsqueeze(-2).expand(rows, hc_mult, embedded.shape[-1])
    carried = initial_carried_pre((rows,), hc_mult, dtype=embedded.dtype, device=embedded.device)
    hashes = None
    if engram_hasher is not None:
        cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        cu = torch.tensor([0, rows * cp_size], device=input_ids.device) if cu_seqlens_padded is None else cu_seqlens_padded
        sequence, _ = _row_positions(cu.to(input_ids.device, torch.long), rows, cp_rank, 0)
        hashes = engram_hasher(input_ids, sequence_ids=sequence + 1, cp_group=cp_group)
    state = CSA2State()
    for layer in layers:
        engram_rows = None if layer.engram is None else hashes[:, facts.engram_layers.index(layer.layer)]
        streams, carried, state = layer(streams, carried, state, engram_rows, cu_seqlens_padded, cp_group)
    return collapse(streams, carried)
