"""Attention kernels in plain PyTorch whose memory is linear in the tokens (floor 1: torch only).

* :mod:`.sparse_attention`: DS4 / V4.1 sparse attention over top-k ids (window + compressed keys, a
  learnable per-head sink), row-chunked with a flash-style backward; the same interface and numbers
  as Megatron-LM ``dev``'s ``unfused_compressed_sparse_attn``, and a dense reference of the same math.
* :mod:`.linear_logprobs`: per-token log-probs and entropy from the LM head's input in row chunks
  (verl's fused ``linear_cross_entropy`` interface; the ``[T, V]`` logits are never held).

Nothing here imports verl or Megatron: :mod:`verl_ds4.mcore.sparse_attention_patch` puts the core
into Megatron-LM ``dev``'s DS4 layers, and the CPU models (:mod:`verl_ds4.models`) call it directly.
"""

from .linear_logprobs import chunked_linear_logprobs, logprobs_chunk_rows
from .indexer import chunked_dense_indexer_kl, chunked_qk_topk, indexer_chunk_rows
from .sparse_attention import (
    DEFAULT_CHUNK_BYTES,
    SPARSE_CORES,
    chunk_rows_for,
    linear_sparse_attn,
    set_sparse_core,
    sparse_attn_reference,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SPARSE_CORES",
    "chunk_rows_for",
    "chunked_dense_indexer_kl",
    "chunked_linear_logprobs",
    "chunked_qk_topk",
    "indexer_chunk_rows",
    "linear_sparse_attn",
    "logprobs_chunk_rows",
    "set_sparse_core",
    "sparse_attn_reference",
]
