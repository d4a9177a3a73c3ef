"""A tiny dense Megatron-Core ``GPTModel`` that runs on CPU with packed THD input.

The stepping stone of the CPU main job: a real Megatron-Core ``GPTModel`` built from
Megatron's *local* layer spec (no TransformerEngine, no CUDA) whose ``core_attention`` is
:class:`TorchTHDCausalAttention`, a pure-PyTorch causal attention over a packed (THD)
buffer. Megatron's own ``DotProductAttention`` rejects packed sequences and calls
``torch.cuda``; this module accepts Megatron's ``PackedSeqParams`` and nothing else.

Layout contract (the same one DS4 attention imposes, see docs/ds4-context-parallel.md s.1):

* the packed buffer of a micro-batch has ``T_pad = cu_seqlens_padded[-1]`` rows, padding at
  the tail of each sequence; ``PackedSeqParams.cu_seqlens_*_padded`` are the *global*
  offsets, identical on every CP rank;
* with context parallelism ``C`` the buffer is split **contiguously**: CP rank ``r`` holds
  rows ``[r*L, (r+1)*L)``, ``L = T_pad / C``;
* positions are derived inside the attention from the global row and
  ``cu_seqlens_padded`` (RoPE is applied here, so the ``GPTModel`` is built with
  ``position_embedding_type="none"``); keys and values are all-gathered over the CP group
  (backward: all-reduce of the key/value gradients, then each rank keeps its own rows).

It is a test/demo model: attention is dense ``[L, T_pad]`` per head, fine for the few
hundred tokens a CPU run packs.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_ds4.models.ds4.cp_comm import all_gather_rows

__all__ = [
    "TorchTHDCausalAttention",
    "register_tiny_dense_cpu_builder",
    "build_tiny_dense_gpt",
    "tiny_dense_layer_spec",
]


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split pairing) of ``x`` [rows, heads, dim] at ``positions`` [rows]."""
    dim = x.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=compute, device=x.device) / dim))
    angles = positions.to(compute)[:, None] * inv_freq[None, :]  # [rows, dim/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    compute = torch.promote_types(x.dtype, torch.float32)
    return (x.to(compute) * cos.to(compute) + rotated.to(compute) * sin.to(compute)).to(x.dtype)


class TorchTHDCausalAttention(MegatronModule):
    """Causal self-attention over a packed THD buffer, contiguous CP, pure PyTorch.

    Drop-in ``core_attention`` for Megatron-Core's ``SelfAttention`` (same constructor and
    ``forward`` signature as ``DotProductAttention``). Requires ``packed_seq_params`` with
    ``qkv_format="thd"``; query [L, heads, dim], key/value [L, groups, dim]; returns
    [L, heads*dim].
    """

    #: verl-ds4's CP partition-mode protocol (verl_ds4.mcore.requirements): contiguous rows, no minimum.
    required_cp_partition_mode = "contiguous"
    min_local_rows = None

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        rope_theta: float = 10000.0,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"TorchTHDCausalAttention supports causal masks only, got {attn_mask_type}.")
        self.layer_number = layer_number
        self.rope_theta = float(rope_theta)
        self.softmax_scale = softmax_scale
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"TorchTHDCausalAttention has no attention dropout (got {dropout}); set attention_dropout=0.0."
            )

    def _cp(self) -> tuple[int, int, object]:
        group = self.cp_group
        if group is None:
            from megatron.core import parallel_state as mpu

            group = mpu.get_context_parallel_group() if mpu.is_initialized() else None
        if group is None or not dist.is_initialized():
            return 0, 1, None
        return dist.get_rank(group), dist.get_world_size(group), group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError(
                "TorchTHDCausalAttention needs packed THD input (PackedSeqParams(qkv_format='thd')); "
                "run the engine with model.use_remove_padding=True."
            )
        if attention_bias is not None:
            raise ValueError("TorchTHDCausalAttention does not support attention_bias.")
        cu_padded = packed_seq_params.cu_seqlens_q_padded
        if cu_padded is None:
            cu_padded = packed_seq_params.cu_seqlens_q
        cu_padded = cu_padded.to(device=query.device, dtype=torch.long)

        cp_rank, cp_size, group = self._cp()
        mode = getattr(packed_seq_params, "cp_partition_mode", None)
        if cp_size > 1 and mode != "contiguous":
            raise ValueError(
                f"TorchTHDCausalAttention needs the contiguous CP split, got cp_partition_mode={mode!r}; "
                "pack the batch with verl_ds4.mcore.thd (the verl-ds4 engine does)."
            )
        local_rows = query.shape[0]
        total_rows = int(cu_padded[-1].item())
        if local_rows * cp_size != total_rows:
            raise ValueError(
                f"Packed buffer has {total_rows} rows (cu_seqlens_padded[-1]) but CP={cp_size} ranks hold "
                f"{local_rows} rows each; the contiguous layout needs T_pad == cp * local_rows."
            )

        rows_q = cp_rank * local_rows + torch.arange(local_rows, device=query.device)
        rows_k = torch.arange(total_rows, device=query.device)
        seq_q = torch.bucketize(rows_q, cu_padded[1:], right=True)
        seq_k = torch.bucketize(rows_k, cu_padded[1:], right=True)
        pos_q = rows_q - cu_padded[seq_q]
        pos_k = rows_k - cu_padded[seq_k]

        if cp_size > 1:
            counts = [key.shape[0]] * cp_size  # contiguous CP: every rank holds the same rows
            key = all_gather_rows(key, counts, group)
            value = all_gather_rows(value, counts, group)

        query = _rope(query, pos_q, self.rope_theta)
        key = _rope(key, pos_k, self.rope_theta)

        heads, groups, dim = query.shape[1], key.shape[1], query.shape[2]
        if heads % groups:
            raise ValueError(f"{heads} query heads are not a multiple of {groups} key/value groups.")
        if groups != heads:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)

        scale = self.softmax_scale if self.softmax_scale is not None else dim**-0.5
        compute = torch.promote_types(query.dtype, torch.float32)  # at least fp32 (fp64 stays fp64)
        scores = torch.einsum("qhd,khd->hqk", query.to(compute), key.to(compute)) * scale
        visible = (seq_q[:, None] == seq_k[None, :]) & (rows_k[None, :] <= rows_q[:, None])
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, value.to(compute)).to(query.dtype)
        return out.reshape(local_rows, heads * dim)


def tiny_dense_layer_spec(rope_theta: float = 10000.0):
    """Megatron's local GPT layer spec (RMSNorm) with :class:`TorchTHDCausalAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.self_attention.submodules.core_attention = functools.partial(
        TorchTHDCausalAttention, rope_theta=rope_theta
    )
    return spec


def build_tiny_dense_gpt(
    tf_config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    rope_theta: float = 10000.0,
    share_embeddings_and_output_weights: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
):
    """Build the tiny dense ``GPTModel`` on CPU (``tf_config.use_cpu_initialization`` must be set)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if not tf_config.use_cpu_initialization:
        raise ValueError("build_tiny_dense_gpt runs on CPU: set use_cpu_initialization=True in the TransformerConfig.")
    return GPTModel(
        config=tf_config,
        transformer_layer_spec=tiny_dense_layer_spec(rope_theta),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="none",
    )


def _dense_transformer_config(hf_config, dtype, overrides):
    from verl.models.mcore.registry import hf_to_mcore_config

    return hf_to_mcore_config(hf_config, dtype, **overrides)


def _dense_build(tf_config, hf_config, *, pre_process, post_process, share_embeddings):
    from verl.utils.megatron_utils import get_hf_rope_theta

    return build_tiny_dense_gpt(
        tf_config,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        rope_theta=get_hf_rope_theta(hf_config),
        share_embeddings_and_output_weights=share_embeddings,
        pre_process=pre_process,
        post_process=post_process,
    )


def register_tiny_dense_cpu_builder() -> None:
    """Register this model with the CPU Megatron engine for HF ``model_type="llama"``.

    Runs on import, so ``model.external_lib=verl_ds4.cpu.tiny_dense`` selects it in verl.
    """
    from verl_ds4.cpu.builders import CPUModelBuilder, register_cpu_model_builder

    register_cpu_model_builder("llama", CPUModelBuilder(_dense_transformer_config, _dense_build))


register_tiny_dense_cpu_builder()
