"""The memory table ``verl-ds4 recipe NAME --dry-run`` and ``plan`` print (one line per role and pass, then the
rollout, the colocated phases and host RAM), from a :class:`~verl_ds4.memory.roles.MemoryReport`."""

from __future__ import annotations

from verl_ds4.memory.stages import peak_stage

__all__ = ["format_memory"]


def format_memory(memory) -> list[str]:
    """The memory table the plan prints (one line per role and pass, then the rollout, the phases, host RAM)."""
    if memory is None:
        return []
    if memory.skipped:
        return [f"memory  : not checked ({memory.skipped})"]
    cap = memory.capacity_gib
    lines = [
        f"memory per GPU (GiB) on {memory.hardware} ({cap:.1f} GiB each, peak limit {memory.limit_gib:.1f} with headroom "
        f"{memory.headroom:g}; check: {memory.mode}); the stage with the highest peak of each pass "
        "(verl_ds4/memory/peak.py; docs/memory.md):"
    ]
    rows = [["role", "pass", "mesh", "kernel", "recompute", "tokens/GPU", "stage", "states", "act.", "transient",
             "logits", "margin", "peak", "fits"]]
    for rm in memory.roles:
        m = rm.mesh
        for name, stages in rm.passes.items():
            s = peak_stage(stages)
            rows.append([
                rm.role, name, f"PP{m.pp}/EP{m.ep}/CP{m.cp} DPxCP {m.dense_dp} eDP {m.expert_dp}", rm.path,
                "full" if rm.recompute is None else (",".join(sorted(rm.recompute)) or "none"),
                str(rm.tokens_per_gpu if name == "update" or not rm.trainable else rm.infer_tokens), str(s.stage),
                f"{s.static_gib:.1f}", f"{s.activations_gib:.1f}", f"{s.transient_gib:.1f}",
                "-" if rm.role == "critic" else f"{rm.logits_kernel} {max(x.logits_gib for x in stages):.1f}",
                f"{s.a2a_gib + s.margin_gib:.1f}",
                f"{s.peak_gib:.1f}", "yes" if s.peak_gib <= memory.limit_gib else "NO",
            ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    lines.append("  states = weights + grads + optimizer; act. = kept by the other micro-batches in flight; transient = the "
                 "peak moment (a layer's backward or the logits' loss buffers); logits = the last stage's loss buffers and what computes "
                 "them (fused: verl's Triton kernel, use_fused_kernels; unfused: the [T, V] logits); margin = all-to-all buffers + "
                 "allocator margin")
    for rm in memory.roles:
        if rm.optimizer.cpu_offload_fraction:
            lines.append(f"  {rm.role}: Megatron CPU optimizer offload {rm.optimizer.cpu_offload_fraction:g} of the optimizer states")
    if memory.rollout:
        r = memory.rollout
        kv = r.get("kv_cache_gib", 0.0)
        ok = r["weights_gib"] + kv <= r["share_gib"]
        cache = (f" + KV cache {kv:.1f} ({r['kv_sequences']} sequences of {r['kv_tokens']:,} tokens per engine)"
                 if "kv_cache_gib" in r else "")
        lines.append(
            f"  rollout: TP{r['tp']} {'fp8' if r['quantization'] == 'fp8' else 'bf16'} weights {r['weights_gib']:.1f}{cache} GiB "
            f"per GPU of a {r['utilization']:g} x {cap:.1f} = {r['share_gib']:.1f} GiB share: {'fits' if ok else 'does NOT fit'}"
        )
    if memory.phases:
        lines.append("  colocated phases (states on the GPU): " + ", ".join(f"{n} {v:.1f}" for n, v in memory.phases))
    if memory.host:
        parts = ", ".join(f"{k} {v:.0f}" for k, v in memory.host.items() if v)
        of = "(RAM unknown)" if memory.host_capacity_gib is None else f"of {memory.host_capacity_gib:.0f}"
        lines.append(f"  host RAM per node ({memory.gpus_per_node} GPUs): {sum(memory.host.values()):.0f} GiB {of}"
                     + (f" ({parts})" if parts else ""))
    return lines
