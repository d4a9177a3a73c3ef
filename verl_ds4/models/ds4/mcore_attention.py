"""Megatron-Core glue for :class:`~verl_ds4.models.ds4.attention.DS4HybridAttention`.

* :class:`DS4ProxyTransformerConfig`: a ``TransformerConfig`` with DS4's attention fields (names as
  in Megatron-LM ``dev``'s DS4 config where it has them: ``csa_compress_ratios``,
  ``csa_window_size``, ``q_lora_rank``, ``o_groups``, ``o_lora_rank``, ``qk_pos_emb_head_dim``,
  ``dsa_indexer_*`` including ``dsa_indexer_loss_coeff`` (the indexer's KL loss, :mod:`.indexer_loss`),
  ``experimental_attention_variant="dsv4_hybrid"``, ``cp_partition_mode``).
* :class:`DS4HybridSelfAttention`: the layer-spec ``self_attention`` module. It takes Megatron's
  ``[s, b, h]`` hidden states and ``PackedSeqParams`` and returns ``(output, bias=None)``.

Input contract (as Megatron-LM's DS4 attention): THD with ``b = 1`` and the global padded
``cu_seqlens_q_padded``; with CP > 1 the rows must be the contiguous split, declared by
``packed_seq_params.cp_partition_mode == "contiguous"`` (megatron-core 0.16.1's ``PackedSeqParams``
has no such field: ``verl_ds4.mcore.thd``'s ``PlannedPackedSeqParams`` declares it; read with
``getattr`` so any ``PackedSeqParams`` works). BSHD input is accepted at CP = 1 only (each batch column is one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .attention import DS4AttentionSpec, DS4HybridAttention
from .device import building_on

__all__ = ["DS4ProxyTransformerConfig", "DS4HybridSelfAttention", "attention_spec_for_layer", "cpu_ds4_settings"]


@dataclass
class DS4ProxyTransformerConfig(TransformerConfig):
    """``TransformerConfig`` plus the DS4 attention sizes (``kv_channels`` is the head dim)."""

    experimental_attention_variant: str | None = "dsv4_hybrid"
    cp_partition_mode: str = "contiguous"
    csa_compress_ratios: list[int] = field(default_factory=lambda: [0])
    csa_window_size: int = 128
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    qk_pos_emb_head_dim: int = 64
    rotary_base: float = 10000.0
    csa_compress_rotary_base: float = 160000.0
    rotary_scaling_factor: float | None = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if len(self.csa_compress_ratios) != self.num_layers:
            raise ValueError(
                f"csa_compress_ratios has {len(self.csa_compress_ratios)} entries for num_layers={self.num_layers}: "
                "give one compression ratio (0, 4 or 128) per layer."
            )
        if self.tensor_model_parallel_size != 1:
            raise ValueError("DS4 attention does not support tensor parallelism: set tensor_model_parallel_size=1.")
        if self.context_parallel_size > 1 and self.cp_partition_mode != "contiguous":
            raise ValueError(
                f"DS4 with context_parallel_size={self.context_parallel_size} needs cp_partition_mode='contiguous', "
                f"got {self.cp_partition_mode!r}."
            )
        if self.dsa_indexer_use_sparse_loss:
            raise ValueError(
                "dsa_indexer_use_sparse_loss=True (the indexer loss over the top-k blocks only) is not implemented by "
                "the CPU DS4 attention; set it False (Megatron-LM dev's default: the dense loss over all visible blocks)."
            )
        for i in range(self.num_layers):  # validate every layer's sizes now, not at the first forward
            attention_spec_for_layer(self, i + 1)

    @property
    def min_local_rows(self) -> int:
        """Rows every CP rank must hold for all layers (max D_window over the layers)."""
        return max(attention_spec_for_layer(self, i + 1).min_local_rows for i in range(self.num_layers))


def cpu_ds4_settings(dtype: torch.dtype, cp_size: int) -> dict:
    """The ``TransformerConfig`` fields every CPU DS4 model (the full DS4 and the attention-only proxy)
    shares: MQA, RMSNorm, SwiGLU without biases or dropout, CPU initialisation, no fused kernels,
    TP = PP = 1 and the given CP size."""
    return dict(
        num_query_groups=1,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=cp_size,
    )


def attention_spec_for_layer(config: DS4ProxyTransformerConfig, layer_number: int) -> DS4AttentionSpec:
    """The DS4 attention sizes of (1-based) layer ``layer_number``."""
    return DS4AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        head_dim=config.kv_channels,
        rope_dim=config.qk_pos_emb_head_dim,
        q_lora_rank=config.q_lora_rank,
        o_groups=config.o_groups,
        o_lora_rank=config.o_lora_rank,
        compress_ratio=int(config.csa_compress_ratios[layer_number - 1]),
        window_size=config.csa_window_size,
        index_n_heads=config.dsa_indexer_n_heads or 1,
        index_head_dim=config.dsa_indexer_head_dim or config.qk_pos_emb_head_dim,
        index_topk=config.dsa_indexer_topk or 1,
        rope_theta=config.rotary_base,
        compress_rope_theta=config.csa_compress_rotary_base,
        yarn_factor=config.rotary_scaling_factor,
        yarn_original_max_position_embeddings=config.original_max_position_embeddings,
        yarn_beta_fast=config.beta_fast,
        yarn_beta_slow=config.beta_slow,
        rms_norm_eps=config.layernorm_epsilon,
        indexer_loss_coeff=float(config.dsa_indexer_loss_coeff or 0.0),
    )


class DS4HybridSelfAttention(DS4HybridAttention, MegatronModule):
    """DS4 hybrid attention as a Megatron-Core layer-spec ``self_attention`` module.

    Declares its CP contract for the engine's layout resolver (inherited from
    :class:`~verl_ds4.models.ds4.attention.DS4HybridAttention`, the protocol of
    :mod:`verl_ds4.mcore.requirements`): ``required_cp_partition_mode = "contiguous"`` and the
    ``min_local_rows`` property (D_window of this layer).
    """

    def __init__(self, config: DS4ProxyTransformerConfig, layer_number: int, pg_collection=None, **unused):
        MegatronModule.__init__(self, config=config)
        if not isinstance(config, DS4ProxyTransformerConfig):
            raise TypeError(f"DS4HybridSelfAttention needs a DS4ProxyTransformerConfig, got {type(config).__name__}.")
        self.layer_number = layer_number
        self.pg_collection = pg_collection
        with building_on(config):  # the config's device (models/ds4/device.py)
            self._build(attention_spec_for_layer(config, layer_number), dtype=config.params_dtype)
        if config.perform_initialization:
            self._initialize(config)

    def _initialize(self, config) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    param.fill_(1.0)
                elif name.endswith("attn_sink") or name.endswith(".ape"):
                    param.zero_()
                elif name == "linear_proj.weight":
                    config.output_layer_init_method(param)
                else:
                    config.init_method(param)

    def _cp_group(self, packed_seq_params):
        if packed_seq_params is not None and getattr(packed_seq_params, "local_cp_size", None) is not None:
            if packed_seq_params.cp_group is None:
                raise ValueError("packed_seq_params.local_cp_size is set (dynamic CP) but cp_group is None.")
            return packed_seq_params.cp_group
        if self.pg_collection is not None and getattr(self.pg_collection, "cp", None) is not None:
            group = self.pg_collection.cp
        elif parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_context_parallel_group()
        else:
            return None
        return group if torch.distributed.get_world_size(group) > 1 else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        **unused,
    ):
        if key_value_states is not None or inference_context is not None:
            raise NotImplementedError("DS4HybridSelfAttention supports training/scoring self-attention only (no cross attention or KV cache).")
        cp_group = self._cp_group(packed_seq_params)
        cp_size = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
        s, b, h = hidden_states.shape
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            if cp_size > 1:
                raise ValueError(
                    "DS4 attention with context parallelism requires packed THD input (qkv_format='thd' with "
                    "PackedSeqParams); got BSHD. Enable sequence packing (verl: model.use_remove_padding=True)."
                )
            rows = hidden_states.transpose(0, 1).reshape(b * s, h)
            cu = torch.arange(b + 1, device=rows.device) * s
            out = DS4HybridAttention.forward(self, rows, cu)
            return out.view(b, s, h).transpose(0, 1), None
        if b != 1:
            raise ValueError(f"THD hidden states must be [rows, 1, hidden], got {tuple(hidden_states.shape)}.")
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        mode = getattr(packed_seq_params, "cp_partition_mode", None)
        real = self._real_seqlens(packed_seq_params) if self._indexer_loss_active() else None
        out = DS4HybridAttention.forward(self, hidden_states[:, 0], cu, cp_group=cp_group, cp_partition_mode=mode, real_seqlens=real)
        return out.unsqueeze(1), None

    @staticmethod
    def _real_seqlens(packed_seq_params):
        """``(real lengths [B] in buffer order, their sum)`` of a THD micro-batch, or ``None`` when every
        row is real. verl fills every ``cu_seqlens*`` field with the padded offsets, so the real lengths
        come from the plan the rows were packed with (no device-to-host copy); without a plan, from
        ``cu_seqlens_q`` where it differs from ``cu_seqlens_q_padded``."""
        plan = getattr(packed_seq_params, "plan", None)
        if plan is not None:
            return plan.cu_seqlens.diff(), int(plan.host_seqlens.sum())
        cu_real, cu_padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
        if cu_real is None or cu_padded is None or cu_real is cu_padded or torch.equal(cu_real, cu_padded):
            return None
        return cu_real.diff(), int(cu_real[-1])
