"""The DS4 decoder: layers of (mHC, RMSNorm, DS4 attention) and (mHC, RMSNorm, DS4 MoE), an HC head.

:class:`DS4TransformerBlock` stands where Megatron-Core's ``TransformerBlock`` stands in a
``GPTModel`` (``model.decoder``): it takes the embedded rows ``[s, b, h]`` and returns the final
normed rows ``[s, b, h]`` for the output layer. Inside, the residual is ``n = hc_mult`` streams
``[s, b, n, h]``: the embedding is replicated into every stream, each layer is::

    x = attn_hc(x,  lambda c: self_attention(input_layernorm(c)))
    x = mlp_hc(x,   lambda c: mlp(pre_mlp_layernorm(c), token_ids))

and the block ends with ``final_layernorm(hc_head(x))``. mHC, the norms and the MoE are row-wise;
only the attention talks across CP ranks (:mod:`.cp_comm`). Hash-routed (``hash_moe``) layers read
``hash_token_ids [s, b]``: the token id of every row this rank holds, packed with the same plan as
the hidden rows (the model passes its own ``input_ids``).

Norms are ``weight * x * rsqrt(mean(x^2) + eps)`` in the input dtype (transformers computes them
in float32; identical at fp64).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from .attention import _RMSNorm
from .device import building_on
from .hyper_connection import DS4HyperConnection, DS4HyperHead
from .mcore_attention import DS4HybridSelfAttention
from .model_config import DS4TransformerConfig
from .moe import DS4MoE, DS4Router

__all__ = ["DS4DecoderLayer", "DS4TransformerBlock"]


class DS4DecoderLayer(MegatronModule):
    """One DS4 layer (1-based ``layer_number``) on streams ``[s, b, n, h]``."""

    def __init__(self, config: DS4TransformerConfig, layer_number: int, pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        dtype, h, eps = config.params_dtype, config.hidden_size, config.layernorm_epsilon
        n, iters, hc_eps = config.num_residual_streams, config.mhc_sinkhorn_iterations, config.mhc_epsilon
        self.attn_hc = DS4HyperConnection(h, n, iters, hc_eps, eps, dtype=dtype)
        self.input_layernorm = _RMSNorm(h, eps, dtype=dtype)
        self.self_attention = DS4HybridSelfAttention(config, layer_number, pg_collection=pg_collection)
        self.mlp_hc = DS4HyperConnection(h, n, iters, hc_eps, eps, dtype=dtype)
        self.pre_mlp_layernorm = _RMSNorm(h, eps, dtype=dtype)
        self.is_hash = config.ds4_mlp_layer_types[layer_number - 1] == "hash_moe"
        router = DS4Router(
            h,
            config.num_moe_experts,
            config.moe_router_topk,
            config.ds4_router_score_function,
            config.ds4_norm_topk_prob,
            config.moe_router_topk_scaling_factor or 1.0,
            hash_vocab=config.ds4_vocab_size if self.is_hash else None,
            dtype=dtype,
        )
        self.mlp = DS4MoE(
            h, router, config.moe_ffn_hidden_size, config.moe_shared_expert_intermediate_size, config.ds4_swiglu_limit, dtype=dtype
        )

    def forward(self, streams: torch.Tensor, packed_seq_params=None, hash_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        s, b, n, h = streams.shape

        def attention(collapsed):
            out, _ = self.self_attention(self.input_layernorm(collapsed), attention_mask=None, packed_seq_params=packed_seq_params)
            return out

        def moe(collapsed):
            ids = None
            if self.is_hash:
                if hash_token_ids is None or hash_token_ids.shape != (s, b):
                    got = None if hash_token_ids is None else tuple(hash_token_ids.shape)
                    raise ValueError(
                        f"Layer {self.layer_number} is a hash_moe layer: it needs hash_token_ids [s, b] = ({s}, {b}), the "
                        f"token ids of this rank's rows packed with the hidden rows' plan; got {got}."
                    )
                ids = hash_token_ids.reshape(-1)
            return self.mlp(self.pre_mlp_layernorm(collapsed).reshape(s * b, h), ids).view(s, b, h)

        streams = self.attn_hc(streams, attention)
        return self.mlp_hc(streams, moe)


class DS4TransformerBlock(MegatronModule):
    """``model.decoder`` of :class:`~verl_ds4.models.ds4.model.DS4Model` (pipeline size 1 only)."""

    def __init__(self, config: DS4TransformerConfig, pre_process: bool = True, post_process: bool = True, pg_collection=None):
        super().__init__(config=config)
        if not (pre_process and post_process):
            raise NotImplementedError("The CPU DS4 block runs the whole model on one pipeline stage (pipeline_model_parallel_size=1).")
        self.pre_process, self.post_process = pre_process, post_process
        dtype, h, eps = config.params_dtype, config.hidden_size, config.layernorm_epsilon
        with building_on(config):  # the config's device (device.py)
            self.layers = torch.nn.ModuleList(
                DS4DecoderLayer(config, i + 1, pg_collection=pg_collection) for i in range(config.num_layers)
            )
            self.hc_head = DS4HyperHead(h, config.num_residual_streams, config.mhc_epsilon, eps, dtype=dtype)
            self.final_layernorm = _RMSNorm(h, eps, dtype=dtype)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's pipeline hook; unused at pipeline size 1."""
        self.input_tensor = input_tensor

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        packed_seq_params=None,
        hash_token_ids: torch.Tensor | None = None,
        inference_context=None,
        return_streams: bool = False,
        **unused,
    ):
        """hidden_states ``[s, b, h]`` embedded rows -> ``[s, b, h]`` normed rows for the LM / value head;
        with ``return_streams`` also the last layer's streams ``[s, b, n, h]`` (before the HC head: MTP's input)."""
        if inference_context is not None:
            raise NotImplementedError("The CPU DS4 model scores and trains only (no KV cache / inference context).")
        streams = hidden_states.unsqueeze(-2).expand(-1, -1, self.config.num_residual_streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, packed_seq_params=packed_seq_params, hash_token_ids=hash_token_ids)
        out = self.final_layernorm(self.hc_head(streams))
        return (out, streams) if return_streams else out
