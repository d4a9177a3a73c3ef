"""Our V4.1 parameter names and NeMo Automodel 0.7.0's (the reference's in-memory names), per module.

Each table maps our name (relative to the module) to the reference's; a tensor with a different
layout says how (``None``: same layout). Used by the fidelity tests to copy weights, and the start of
the checkpoint mapping (DeepSeek's on-disk names follow in a later step).
"""

from __future__ import annotations

#: verl_ds4.models.ds41.engram.DS41Engram <- nemo ...deepseek_v41.engram.DeepseekV41Engram
ENGRAM = {
    "multi_head_embedding.weight": "embed.weight",  # the reference pads rows to its owner-group size
    "linear_kv_proj.weight": "wkv.weight",
    "query_norm.weight": "q_weight",
    "key_norm.weight": "k_weight",
}

#: verl_ds4.models.ds41.hyper_connection.DS41HyperConnection <- ...layers.DeepseekV41HyperConnection
HYPER_CONNECTION = {
    "mapping_proj.weight": "fn",
    "bias": "base",
    "alpha_pre": "scale[0]",
    "alpha_post": "scale[1]",
    "alpha_res": "scale[2]",
}

#: verl_ds4.models.ds41.csa2.DS41Attention <- ...attention.DeepseekV41Attention (present per role)
ATTENTION = {
    "linear_q_down_proj.weight": "wq_a.weight",
    "q_layernorm.weight": "q_norm.weight",
    "linear_q_up_proj.weight": "wq_b.weight",
    "linear_kv_proj.weight": "wkv.weight",
    "kv_layernorm.weight": "kv_norm.weight",
    "linear_o_group_proj": "wo_a.weight",
    "linear_proj.weight": "wo_b.weight",
    "core_attention.attn_sink": "sinks_param.weight",
    "core_attention.compressor.linear_wkv.weight": "compressor.wkv.weight",
    "core_attention.compressor.linear_wgate.weight": "compressor.wgate.weight",
    "core_attention.compressor.norm.weight": "compressor.norm.weight",
    "core_attention.indexer.linear_wq_b.weight": "indexer.wq_b.weight",
    "core_attention.indexer.linear_weights_proj.weight": "indexer.weights_proj.weight",
    "core_attention.indexer.linear_wk.weight": "indexer.wk.weight",
    "core_attention.indexer.k_norm.weight": "indexer.k_norm.weight",
}
