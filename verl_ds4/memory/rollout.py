"""The rollout's KV cache during generation: the recipe's lengths and concurrency against vLLM's share (pure Python).

vLLM takes ``gpu_memory_utilization`` of each GPU for its weights (:func:`verl_ds4.memory.stages.rollout_weights_gib`)
and its KV cache. The cache one GPU holds is its engine's (:func:`verl_ds4.memory.terms.rollout_kv_cache_bytes`:
vLLM's ``fp8_ds_mla`` entries; one KV head, so vLLM's TP replicates it on every GPU of the engine) for

* the **length** of a sequence: ``actor_rollout_ref.rollout.prompt_length + response_length`` (verl's, which
  follow ``data.max_prompt_length`` / ``data.max_response_length``, derived from ``ds4.max_seq_len``);
* the **sequences one engine holds at once**: verl sends a step's ``data.train_batch_size x rollout.n`` sequences
  to the engines together; there are ``world / rollout TP`` engines (a replica of ``TP x DP`` GPUs runs ``DP``
  engines of ``TP`` GPUs, so the rollout's ``data_parallel_size`` does not change the count), and vLLM runs at
  most ``max_num_seqs`` of them at once per engine: ``min(max_num_seqs, ceil(batch x n / engines))``.

Every sequence at its full length must fit beside the weights; otherwise vLLM preempts and recomputes
sequences during generation (or refuses to start when not even one fits). :func:`kv_cache_findings` refuses that
with the levers that fit (each recomputed): a lower ``max_num_seqs``, a larger rollout TP, FP8 rollout weights,
a higher ``gpu_memory_utilization`` (while generation still fits beside the training roles' resident states) and
a shorter length. Not counted: vLLM's activation work space of its profile run and its CUDA graphs (they come out
of the same share: keep some of it free).
"""

from __future__ import annotations

import math

from verl_ds4 import ds41_facts, ds4_facts
from verl_ds4.memory.stages import GIB, rollout_weights_gib
from verl_ds4.memory.terms import rollout_kv_cache_bytes
from verl_ds4.memory.types import Finding, MemoryInputs, RolloutInput

__all__ = ["engine_sequences", "kv_cache_findings", "kv_cache_gib"]

#: The granularity of the "shorter length" lever (tokens), and the highest ``gpu_memory_utilization`` it suggests.
_LENGTH_STEP = 1024
_MAX_UTILIZATION = 0.95


def engine_sequences(rollout: RolloutInput, world: int, tp: int | None = None) -> int:
    """Sequences one engine (``tp`` GPUs) holds at once: ``min(max_num_seqs, ceil(batch x n / engines))``."""
    tp = tp or rollout.tp
    engines = max(world // max(tp, 1), 1)
    cap = rollout.max_num_seqs if rollout.max_num_seqs else None
    sent = math.ceil(rollout.batch_sequences / engines) if rollout.batch_sequences else None
    if cap is None and sent is None:
        return 1
    return min(x for x in (cap, sent) if x is not None)


def kv_cache_gib(sizes, length: int, sequences: int) -> float:
    """KV cache per GPU (GiB) of ``sequences`` sequences of ``length`` tokens, V4 or V4.1 (its source layers, MXFP4 index)."""
    roles = getattr(sizes, "roles", ())
    if roles:  # V4.1: only the Full layers own compressed KV; Full and Reindex layers their index keys
        kv = [i for i, r in enumerate(roles) if r == ds41_facts.FULL]
        index = [i for i, r in enumerate(roles) if r in (ds41_facts.FULL, ds41_facts.REINDEX)]
        cache = rollout_kv_cache_bytes(sizes.compress_ratios, length, sequences, window=ds4_facts.DEFAULT_WINDOW,
                                       kv_source_layers=kv, index_source_layers=index, index_cache="mxfp4")
    else:
        cache = rollout_kv_cache_bytes(sizes.compress_ratios, length, sequences, window=ds4_facts.DEFAULT_WINDOW)
    return cache / GIB


def _fits(sizes, rollout: RolloutInput, world: int, cap: float, *, tp=None, quantization=..., utilization=None,
          sequences=None, length=None) -> bool:
    tp = tp or rollout.tp
    quant = rollout.quantization if quantization is ... else quantization
    share = (utilization or rollout.utilization) * cap
    seqs = sequences or engine_sequences(rollout, world, tp)
    return rollout_weights_gib(sizes, tp, quant) + kv_cache_gib(sizes, length or rollout.length, seqs) <= share


def _levers(inputs: MemoryInputs, memory, seqs: int) -> list[str]:
    sizes, r, world, cap = inputs.sizes, inputs.rollout, inputs.world, memory.capacity_gib
    out = []
    fewer = next((k for k in range(seqs - 1, 0, -1) if _fits(sizes, r, world, cap, sequences=k)), None)
    if fewer:
        out.append(f"fewer sequences at once: actor_rollout_ref.rollout.max_num_seqs={fewer} (generation runs in more waves)")
    for tp in (r.tp * 2**i for i in range(1, 8)):
        if tp <= world and world % tp == 0 and _fits(sizes, r, world, cap, tp=tp):
            spans = " (spans nodes: needs a multi-node rollout engine)" if tp > inputs.gpus_per_node else ""
            out.append(f"a larger rollout TP: ds4.rollout.tp={tp}{spans}")
            break
    if r.quantization != "fp8" and _fits(sizes, r, world, cap, quantization="fp8"):
        out.append("FP8 rollout weights: ds4.rollout.quantization=fp8")
    resident = sum(rm.resident_gib for rm in memory.roles)
    steps = range(math.floor(r.utilization * 20) + 1, round(_MAX_UTILIZATION * 20) + 1)
    more = next((u / 20 for u in steps if resident + u / 20 * cap <= cap and _fits(sizes, r, world, cap, utilization=u / 20)), None)
    if more:
        out.append(f"a larger share for vLLM: ds4.rollout.gpu_memory_utilization={more:g}")
    shorter = next((n for n in range((r.length - 1) // _LENGTH_STEP * _LENGTH_STEP, 0, -_LENGTH_STEP)
                    if _fits(sizes, r, world, cap, length=n)), None)
    if shorter and inputs.max_seq_len_knob is not None:
        out.append(f"shorter sequences: ds4.max_seq_len={shorter} (launcher MAX_SEQ_LEN)")
    elif shorter and shorter > r.prompt_length:
        out.append(f"shorter responses: data.max_response_length={shorter - r.prompt_length}")
    return out


def kv_cache_findings(inputs: MemoryInputs, memory, problems: list[Finding]) -> None:
    """Add the KV cache to ``memory.rollout`` and a finding when it does not fit vLLM's share beside the weights."""
    sizes, r, cap = inputs.sizes, inputs.rollout, memory.capacity_gib
    if not r.length:
        return
    seqs = engine_sequences(r, inputs.world)
    kv = kv_cache_gib(sizes, r.length, seqs)
    weights, share = memory.rollout["weights_gib"], memory.rollout["share_gib"]
    memory.rollout.update(kv_cache_gib=kv, kv_sequences=seqs, kv_tokens=r.length)
    if weights > share or weights + kv <= share:  # the weights alone are refused already
        return
    engines = max(inputs.world // r.tp, 1)
    sent = f"{r.batch_sequences} sequences per step over {engines} engines of TP{r.tp}" if r.batch_sequences else "the batch"
    fix = _levers(inputs, memory, seqs)
    problems.append(Finding(
        "rollout KV cache",
        f"one {r.name} engine holds {seqs} sequences of {r.length:,} tokens at once (min of max_num_seqs {r.max_num_seqs} "
        f"and {sent}); their KV cache, replicated on each GPU of the engine, is {kv:.1f} GiB per GPU "
        f"({kv * 1024 / seqs:.0f} MiB a sequence), more than the {share - weights:.1f} GiB that gpu_memory_utilization "
        f"{r.utilization:g} x {cap:.1f} GiB = {share:.1f} GiB leaves beside the rollout weights ({weights:.1f} GiB): vLLM "
        "would preempt and recompute sequences during generation.",
        ("smallest changes that fit: " + "; ".join(fix)) if fix else
        "more GPUs for the rollout, or a shorter ds4.max_seq_len (launcher MAX_SEQ_LEN).",
    ))
