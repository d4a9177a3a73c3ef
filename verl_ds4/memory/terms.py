"""Two memory terms that grow with the tokens, as pure functions: the logits step and the rollout's KV cache.

Nothing here reads a recipe (pure Python, no torch); the peak model calls these with numbers it already has:
:func:`verl_ds4.memory.peak.step_peak` counts :func:`logits_step_bytes` on a pipeline's last stage for the
kernel the role runs (``RoleInput.logits_kernel``), and :mod:`verl_ds4.memory.rollout` compares
:func:`rollout_kv_cache_bytes` for the recipe's lengths and concurrency with vLLM's share less the rollout weights.

**The logits step** (:func:`logits_step_bytes`), per GPU, ``V`` = this rank's vocabulary rows (``V / TP``;
DS4 runs TP 1, so 129,280), ``H`` the hidden size, ``T`` the GPU's tokens in one micro-batch:

* verl 0.9.1's non-fused path (``use_fused_kernels=False``: Megatron's output layer gives the ``[T, V]``
  logits, verl's ``_lm_head_logits_processor`` takes them), bytes per ``[T, V]`` entry at the loss's
  peak (:data:`UNFUSED_BYTES_PER_LOGIT`): ``sft`` and an actor update without the entropy term keep the
  fp32 softmax of ``vocab_parallel_cross_entropy`` (4) beside the bf16 logits (2) and the backward's
  bf16 gradient (2): 8; an actor update with the entropy term also keeps ``_VocabParallelEntropy``'s
  bf16 logits and softmax and the logits' clone (+6): 14; the old-log-prob forward (entropy on) the
  logits, their clone, the entropy's shifted copy and the fp32 cross-entropy copy: 12; the reference
  forward the logits and the fp32 copy: 6; a value head (``[T, 1]``) nothing of note. Each MTP depth
  (SFT with ``ds4.mtp``) adds its own logits' fp32 softmax and bf16 logits: 6. That is ~1-1.8 MiB per
  token at ``V`` = 129,280: it is the term that decides long sequences.
* verl's fused kernel (``use_fused_kernels=True``: verl's Triton ``linear_cross_entropy``, called by
  verl-ds4's fused forward, :mod:`verl_ds4.mcore.model_forward_fused`): the forward keeps 5 fp32
  numbers per token (log-prob, entropy, max, sum, entropy term) and works on ``[T, ceil(V / 1024)]``
  fp32 partials (3 of them); the backward (verl's default ``_Split_Dlogits_N``) writes ``d logits`` for
  one 9,504-column slice of the vocabulary at a time, ``[T, 9504]`` in the hidden's dtype (bf16),
  and the weight's gradient ``[V, H]`` bf16 once (fixed, not per token). Per token: forward
  ``20 + 12 ceil(V / 1024)`` (1,544 at 129,280), training ``20 + 2 * 9504`` (19,028): ~55x and ~95x
  less than the non-fused path.
* verl-ds4's chunked function (:func:`verl_ds4.kernels.chunked_linear_logprobs`, chunk of
  ``chunk_bytes``): 4 fp32 numbers per token kept (log-prob, entropy, log-sum-exp, entropy for the
  backward), at most 3 chunks of fp32 logits in the forward and 3 in the backward (fixed), and the
  fp32 weight gradient ``[V, H]`` (fixed).

Not counted here (the rest of the model counts them): the hidden states entering the head and their
gradient ``[T, H]``, the head's weight and its main gradient.

**The rollout's KV cache** (:func:`rollout_kv_cache_bytes`): vLLM's DeepSeek-V4 model accepts only an
fp8 KV cache and stores it in the ``fp8_ds_mla`` layout (vLLM's ``DeepseekV4`` attention converts any
``fp8*`` ``kv_cache_dtype`` to it): one 512-wide latent per cached entry as 448 fp8 values, 64 bf16
RoPE values and 8 scale bytes (7 UE8M0 + 1 pad): :data:`DS_MLA_ENTRY_BYTES` = 584 (vLLM's compressed
KV page ``[256 // 4, 584]``). Per layer and sequence of ``L`` tokens:

* the sliding window: ``window`` (128) entries, every layer;
* a compressed layer with ratio ``r`` (V4: CSA 4, HCA 128; V4.1: 1, 2) that owns its compressed KV (V4:
  every compressed layer; V4.1: the ``kv_source_layer_ids`` only, the Reuse / Reindex layers read it):
  ``ceil(L / r)`` entries;
* a layer with its own indexer keys (V4: the CSA layers; V4.1: ``index_source_layer_ids``):
  ``ceil(L / r)`` index keys of 128 dims, fp8 + one fp32 scale (132 bytes; V4.1's MXFP4 cache: 64 +
  4 scale bytes = 68);
* the compressors' fp32 state (a sequence's unfinished block): ``2 * coff * d * 4`` bytes a row for
  ``coff * r`` rows (``coff`` = 2 for ratio 4, else 1; ``d`` = 512, or 128 for the indexer's).

``L`` is rounded up to vLLM's page (``block_tokens``, 256 in the DS4 recipes' vLLM settings). The
latent is one KV head, so vLLM's tensor parallelism replicates it: count the sequences one GPU's
engine holds at once (its share of ``max_num_seqs``), not a TP shard of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "CHUNK_BYTES",
    "DS_MLA_ENTRY_BYTES",
    "FUSED_D_LOGITS_COLUMNS",
    "LOGITS_PASSES",
    "LogitsBytes",
    "UNFUSED_BYTES_PER_LOGIT",
    "logits_step_bytes",
    "rollout_kv_cache_bytes",
]

#: Work space of one chunk: the linear core's backward, the chunked indexer and the chunked logits
#: (``verl_ds4.kernels.sparse_attention.DEFAULT_CHUNK_BYTES``; kept equal by tests/test_memory_linear_on_cpu.py).
CHUNK_BYTES = 256 * 1024**2
#: Bytes per ``[T, V]`` entry at the loss's peak, verl 0.9.1's non-fused path (derivation above).
UNFUSED_BYTES_PER_LOGIT = {"sft": 8, "actor": 14, "actor_no_entropy": 8, "logprob": 12, "ref": 6, "value": 0}
#: Each MTP depth's logits in a training step (non-fused; verl gives MTP no fused kernel).
MTP_BYTES_PER_LOGIT = 6
#: The passes :func:`logits_step_bytes` knows.
LOGITS_PASSES = ("sft", "actor", "logprob", "ref", "value")
#: verl's Triton kernel: vocabulary columns of one forward partial, and of one backward ``d logits`` slice.
FUSED_FORWARD_SPLIT = 1024
FUSED_D_LOGITS_COLUMNS = 9504
#: vLLM's ``fp8_ds_mla`` entry for DS4's 512-wide latent (448 fp8 + 64 bf16 RoPE + 8 scale bytes).
DS_MLA_ENTRY_BYTES = 448 + 64 * 2 + 8
#: One index key (128 dims): fp8 + an fp32 scale (V4), MXFP4 + 4 UE8M0 scales (V4.1).
INDEX_KEY_BYTES = {"fp8": 128 + 4, "mxfp4": 64 + 4}


@dataclass(frozen=True)
class LogitsBytes:
    """The logits step's memory: ``per_token * T + fixed`` bytes, and what runs (``kind``)."""

    per_token: float
    fixed: int
    kind: str  # "unfused", "fused" (verl's Triton kernel) or "chunked" (verl-ds4's function)

    def at(self, tokens: int) -> float:
        return self.per_token * tokens + self.fixed


def logits_step_bytes(
    pass_: str,
    *,
    vocab: int,
    hidden: int,
    kind: str = "unfused",
    entropy: bool = True,
    mtp_depths: int = 0,
    chunk_bytes: int = CHUNK_BYTES,
    weight_bytes: int = 2,
) -> LogitsBytes:
    """The logits step of one pass (``sft``, ``actor`` update, old-``logprob`` forward, ``ref`` forward,
    ``value``) on one GPU: ``vocab`` = this rank's vocabulary rows, ``hidden`` the hidden size, ``kind``
    what computes it (module docstring), ``entropy`` whether the actor update has the entropy term,
    ``mtp_depths`` the MTP depths trained beside it (non-fused only: verl refuses fused kernels with MTP)."""
    if pass_ not in LOGITS_PASSES:
        raise ValueError(f"pass {pass_!r} is not one of {LOGITS_PASSES}.")
    if kind not in ("unfused", "fused", "chunked"):
        raise ValueError(f"kind {kind!r}: expected 'unfused', 'fused' or 'chunked'.")
    if mtp_depths and kind != "unfused":
        raise ValueError(f"kind={kind!r} with {mtp_depths} MTP depths: verl 0.9.1 runs MTP only on the non-fused path.")
    if pass_ == "value":
        return LogitsBytes(0.0, 0, kind)
    training = pass_ in ("sft", "actor")
    if kind == "unfused":
        key = "actor" if pass_ == "actor" and entropy else "actor_no_entropy" if pass_ == "actor" else pass_
        per_entry = UNFUSED_BYTES_PER_LOGIT[key] + MTP_BYTES_PER_LOGIT * mtp_depths
        return LogitsBytes(float(per_entry * vocab), 0, kind)
    if kind == "fused":
        if training:
            return LogitsBytes(20.0 + weight_bytes * min(vocab, FUSED_D_LOGITS_COLUMNS), weight_bytes * vocab * hidden, kind)
        return LogitsBytes(20.0 + 12.0 * math.ceil(vocab / FUSED_FORWARD_SPLIT), 0, kind)
    chunk_rows = max(1, chunk_bytes // (4 * vocab))
    work = 3 * chunk_rows * vocab * 4
    return LogitsBytes(16.0, work + (4 * vocab * hidden if training else 0), kind)


def rollout_kv_cache_bytes(
    compress_ratios: Sequence[int],
    tokens: int,
    sequences: int,
    *,
    window: int = 128,
    kv_source_layers: Sequence[int] | None = None,
    index_source_layers: Sequence[int] | None = None,
    index_cache: str = "fp8",
    block_tokens: int = 256,
) -> int:
    """Bytes of vLLM's DS4 / V4.1 KV cache for ``sequences`` sequences of ``tokens`` tokens (prompt +
    response) held at once by one GPU's engine. ``compress_ratios`` per decoder layer (0 window only);
    V4: leave the source lists ``None`` (every compressed layer owns its KV, the ratio-4 layers their
    index keys); V4.1: ``kv_source_layer_ids`` / ``index_source_layer_ids`` and ``index_cache="mxfp4"``."""
    if tokens < 0 or sequences < 0 or block_tokens < 1 or window < 0:
        raise ValueError(f"tokens ({tokens}), sequences ({sequences}), window ({window}) and block_tokens "
                         f"({block_tokens}) must be non-negative (block_tokens positive).")  # fmt: skip
    if index_cache not in INDEX_KEY_BYTES:
        raise ValueError(f"index_cache {index_cache!r}: expected one of {sorted(INDEX_KEY_BYTES)}.")
    ratios = list(compress_ratios)
    kv_src = {i for i, r in enumerate(ratios) if r} if kv_source_layers is None else set(kv_source_layers)
    idx_src = {i for i, r in enumerate(ratios) if r == 4} if index_source_layers is None else set(index_source_layers)
    length = math.ceil(tokens / block_tokens) * block_tokens
    per_sequence = 0
    for layer, ratio in enumerate(ratios):
        per_sequence += window * DS_MLA_ENTRY_BYTES
        if not ratio:
            continue
        coff = 2 if ratio == 4 else 1
        entries = math.ceil(length / ratio)
        if layer in kv_src:
            per_sequence += entries * DS_MLA_ENTRY_BYTES + 2 * coff * 512 * 4 * coff * ratio
        if layer in idx_src:
            per_sequence += entries * INDEX_KEY_BYTES[index_cache] + 2 * coff * 128 * 4 * coff * ratio
    return per_sequence * sequences
