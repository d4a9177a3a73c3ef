"""A tiny dense ``GPTModel`` whose pure-PyTorch attention consumes the **zigzag** CP split.

verl 0.9.1's stock Megatron engine packs every non-DS4 model zigzag (its
``_get_context_parallel_layout`` rule). To compare verl's engine data path with ours on the same
model (``verl_ds4.testing.engine_differential``), the model's attention must take zigzag rows on
both; the tiny dense model of the CPU jobs (:mod:`verl_ds4.cpu.tiny_dense`) takes contiguous rows.

:class:`ZigzagTHDCausalAttention` is a drop-in ``core_attention`` (the signature of Megatron's
``DotProductAttention``): CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every sequence
(each sequence's padded length a multiple of ``2 cp``); the attention maps its rows and the
all-gathered key/value rows of every rank to global buffer rows, and attends causally within each
sequence with RoPE at the global position. It reads the split from ``PackedSeqParams`` (the field
``cp_partition_mode`` where the installed Megatron-Core has one; Megatron's default, zigzag, where
it does not) and refuses contiguous rows. For tests and benchmarks only.
"""

from __future__ import annotations

import functools

import torch

from verl_ds4.cpu.tiny_dense import TorchTHDCausalAttention, _rope, tiny_dense_layer_spec
from verl_ds4.models.ds4.cp_comm import all_gather_rows

__all__ = ["ZigzagTHDCausalAttention", "global_rows", "register_zigzag_dense_cpu_builder"]


def global_rows(cu_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """``[T_pad / cp]`` global buffer row of each local row of a zigzag ``cp_rank``."""
    lengths = cu_padded.diff()
    half = lengths // (2 * cp_size)
    local_starts = cu_padded[:-1] // cp_size
    local_rows = int(cu_padded[-1].item()) // cp_size
    row = torch.arange(local_rows, device=cu_padded.device)
    seq = torch.bucketize(row, local_starts[1:], right=True)
    offset = row - local_starts[seq]
    first = offset < half[seq]
    chunk = torch.where(first, torch.full_like(offset, cp_rank), torch.full_like(offset, 2 * cp_size - 1 - cp_rank))
    within = torch.where(first, offset, offset - half[seq])
    return cu_padded[:-1][seq] + chunk * half[seq] + within


class ZigzagTHDCausalAttention(TorchTHDCausalAttention):
    """Causal THD attention over zigzag CP rows (see the module docstring)."""

    required_cp_partition_mode = "zigzag"
    min_local_rows = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("ZigzagTHDCausalAttention needs packed THD input (PackedSeqParams(qkv_format='thd')).")
        cu_padded = packed_seq_params.cu_seqlens_q_padded
        cu_padded = (packed_seq_params.cu_seqlens_q if cu_padded is None else cu_padded).to(query.device, torch.long)
        cp_rank, cp_size, group = self._cp()
        mode = getattr(packed_seq_params, "cp_partition_mode", None) or "zigzag"
        if cp_size > 1 and mode != "zigzag":
            raise ValueError(f"ZigzagTHDCausalAttention consumes the zigzag CP split, got cp_partition_mode={mode!r}.")
        local_rows = query.shape[0]
        if local_rows * cp_size != int(cu_padded[-1].item()):
            raise ValueError(f"{local_rows} local rows x CP={cp_size} != {int(cu_padded[-1].item())} padded rows.")
        rows_q = global_rows(cu_padded, cp_rank, cp_size)
        if cp_size > 1:
            counts = [local_rows] * cp_size
            key = all_gather_rows(key, counts, group)
            value = all_gather_rows(value, counts, group)
            rows_k = torch.cat([global_rows(cu_padded, r, cp_size) for r in range(cp_size)])
        else:
            rows_k = rows_q
        seq_q = torch.bucketize(rows_q, cu_padded[1:], right=True)
        seq_k = torch.bucketize(rows_k, cu_padded[1:], right=True)
        query = _rope(query, rows_q - cu_padded[seq_q], self.rope_theta)
        key = _rope(key, rows_k - cu_padded[seq_k], self.rope_theta)
        heads, groups, dim = query.shape[1], key.shape[1], query.shape[2]
        if groups != heads:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        scale = self.softmax_scale if self.softmax_scale is not None else dim**-0.5
        compute = torch.promote_types(query.dtype, torch.float32)
        scores = torch.einsum("qhd,khd->hqk", query.to(compute), key.to(compute)) * scale
        visible = (seq_q[:, None] == seq_k[None, :]) & (rows_k[None, :] <= rows_q[:, None])
        probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, value.to(compute)).to(query.dtype)
        return out.reshape(local_rows, heads * dim)


def _zigzag_spec(rope_theta: float):
    spec = tiny_dense_layer_spec(rope_theta)
    spec.submodules.self_attention.submodules.core_attention = functools.partial(
        ZigzagTHDCausalAttention, rope_theta=rope_theta
    )
    return spec


def register_zigzag_dense_cpu_builder() -> None:
    """Register the zigzag tiny dense model as the CPU builder of ``llama`` (replaces the contiguous one)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from verl.utils.megatron_utils import get_hf_rope_theta

    from verl_ds4.cpu import tiny_dense
    from verl_ds4.cpu.builders import CPUModelBuilder, register_cpu_model_builder

    def build(tf_config, hf_config, *, pre_process, post_process, share_embeddings):
        return GPTModel(
            config=tf_config,
            transformer_layer_spec=_zigzag_spec(get_hf_rope_theta(hf_config)),
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings,
            position_embedding_type="none",
        )

    register_cpu_model_builder("llama", CPUModelBuilder(tiny_dense._dense_transformer_config, build))
