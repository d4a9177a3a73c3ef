"""Map weights between transformers' ``DeepseekV4Attention`` and :class:`DS4HybridAttention`.

Channel conventions: transformers' docstring describes the partial RoPE on the *first* channels,
but its ``apply_rotary_pos_emb`` rotates the *trailing* ``rope_dim`` channels (``x[..., -rope_dim:]``)
in interleaved pairs, which is also Megatron-LM's and our layout. So the mapping is a renaming with
identical shapes and no channel permutation; the fidelity test (tests/test_ds4_attention_fidelity_on_cpu.py)
would fail if either side changed its convention.

The grouped output projection stores the same ``[o_groups * o_lora_rank, n_heads * head_dim / o_groups]``
matrix on both sides (transformers: ``o_a_proj.weight``; here: ``linear_o_group_proj``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .attention import DS4AttentionSpec, layer_kind_for_ratio

__all__ = ["HF_TO_DS4_NAMES", "hf_to_ds4_state_dict", "ds4_to_hf_state_dict", "spec_from_hf_config"]

# transformers DeepseekV4Attention parameter name -> DS4HybridAttention parameter name
HF_TO_DS4_NAMES: dict[str, str] = {
    "q_a_proj.weight": "linear_q_down_proj.weight",
    "q_a_norm.weight": "q_layernorm.weight",
    "q_b_proj.weight": "linear_q_up_proj.weight",
    "kv_proj.weight": "linear_kv_proj.weight",
    "kv_norm.weight": "kv_layernorm.weight",
    "sinks": "core_attention.attn_sink",
    "o_a_proj.weight": "linear_o_group_proj",
    "o_b_proj.weight": "linear_proj.weight",
    "compressor.kv_proj.weight": "core_attention.compressor.linear_wkv.weight",
    "compressor.gate_proj.weight": "core_attention.compressor.linear_wgate.weight",
    "compressor.position_bias": "core_attention.compressor.ape",
    "compressor.kv_norm.weight": "core_attention.compressor.norm.weight",
    "compressor.indexer.kv_proj.weight": "core_attention.indexer.compressor.linear_wkv.weight",
    "compressor.indexer.gate_proj.weight": "core_attention.indexer.compressor.linear_wgate.weight",
    "compressor.indexer.position_bias": "core_attention.indexer.compressor.ape",
    "compressor.indexer.kv_norm.weight": "core_attention.indexer.compressor.norm.weight",
    "compressor.indexer.q_b_proj.weight": "core_attention.indexer.linear_wq_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "core_attention.indexer.linear_weights_proj.weight",
}
_DS4_TO_HF_NAMES = {v: k for k, v in HF_TO_DS4_NAMES.items()}


def _rename(state: Mapping[str, torch.Tensor], table: Mapping[str, str], side: str) -> dict[str, torch.Tensor]:
    out, unknown = {}, []
    for name, tensor in state.items():
        if name not in table:
            unknown.append(name)
            continue
        out[table[name]] = tensor
    if unknown:
        raise KeyError(f"No DS4 weight mapping for {side} parameter(s) {unknown}; known: {sorted(table)}.")
    return out


def hf_to_ds4_state_dict(hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``DeepseekV4Attention.state_dict()`` (buffers ignored) -> ``DS4HybridAttention`` state dict."""
    params = {k: v for k, v in hf_state.items() if "rotary_emb" not in k}
    return _rename(params, HF_TO_DS4_NAMES, "transformers")


def ds4_to_hf_state_dict(ds4_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_ds4_state_dict` (rotary buffers are rebuilt by transformers)."""
    params = {k: v for k, v in ds4_state.items() if k != "inv_freq"}
    return _rename(params, _DS4_TO_HF_NAMES, "DS4")


def spec_from_hf_config(config: Any, layer_idx: int) -> DS4AttentionSpec:
    """The :class:`DS4AttentionSpec` of layer ``layer_idx`` of a transformers ``DeepseekV4Config``."""
    layer_type = config.layer_types[layer_idx]
    ratio = 0 if layer_type == "sliding_attention" else int(config.compress_rates[layer_type])
    expected = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    if layer_kind_for_ratio(ratio) != expected[layer_type]:
        raise ValueError(
            f"Layer {layer_idx} is {layer_type} with compress rate {ratio}; this implementation ties CSA "
            "(overlap + indexer) to ratio 4 and HCA to other ratios > 1, as DS4 and Megatron-LM do."
        )
    compress = config.rope_parameters["compress"]
    yarn = compress.get("rope_type", "default") == "yarn"
    if yarn and float(compress.get("attention_factor", 1.0)) != 1.0:
        raise ValueError("DS4 compressed layers use YaRN with attention_factor (mscale) 1.0.")
    if yarn and not compress.get("truncate", True):
        raise ValueError("Only YaRN with truncate=True (the default) is implemented.")
    return DS4AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        rope_dim=int(config.qk_rope_head_dim),
        q_lora_rank=config.q_lora_rank,
        o_groups=config.o_groups,
        o_lora_rank=config.o_lora_rank,
        compress_ratio=ratio,
        window_size=config.sliding_window,
        index_n_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim,
        index_topk=config.index_topk,
        rope_theta=float(config.rope_parameters["main"]["rope_theta"]),
        compress_rope_theta=float(compress["rope_theta"]),
        yarn_factor=float(compress["factor"]) if yarn else None,
        yarn_original_max_position_embeddings=int(compress.get("original_max_position_embeddings") or 0) if yarn else 0,
        yarn_beta_fast=float(compress.get("beta_fast") or 32.0),
        yarn_beta_slow=float(compress.get("beta_slow") or 1.0),
        rms_norm_eps=config.rms_norm_eps,
    )
