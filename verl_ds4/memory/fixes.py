"""What does not fit, and the smallest changes that do (the refusals of the memory check).

:func:`findings` turns a :class:`~verl_ds4.memory.roles.MemoryReport` into findings (:class:`~verl_ds4.memory.types.Finding`):
a role whose peak (:mod:`verl_ds4.memory.peak`: states + activations + the peak moment + the margin)
exceeds the GPU less the headroom, roles that do not fit beside each other, a rollout whose weights or KV cache
(:mod:`verl_ds4.memory.rollout`) do not fit vLLM's share, and host RAM per node. :func:`fixes` searches, for one role, the smallest change in each
direction that brings its peak under the limit: a lower token budget per GPU (with the CP the longest
sequence then needs), full recompute, the memory-linear sparse attention in place of Megatron's unfused
core, the fused attention kernel where the GPU runs it, a larger EP or
PP, more GPUs, Megatron's CPU optimizer offload. Every candidate is recomputed with the same model, so
a lever that does not lower the peak enough is never suggested.
"""

from __future__ import annotations

import dataclasses

from verl_ds4.memory.host import host_findings
from verl_ds4.memory.rollout import kv_cache_findings
from verl_ds4.memory.stages import GPU_MEMORY_GIB, peak_stage, rollout_weights_gib
from verl_ds4.memory.types import Finding, MemoryInputs

__all__ = ["findings", "fixes", "rollout_fixes", "BUDGET_KEYS", "OPTIM_KEYS"]

_MAX_NODE_FACTOR = 16
#: The recipe settings the levers name (the recipe layer reads the optimizer blocks from the same keys).
#: Where each trainable role's optimizer settings live in a composed recipe.
OPTIM_KEYS = {"sft": "optim", "actor": "actor_rollout_ref.actor.optim", "critic": "critic.optim"}
#: The recipe knob of each pass's token budget.
BUDGET_KEYS = {"update": "ds4.max_token_len_per_gpu", "forward": "ds4.infer_max_token_len_per_gpu"}
_MIN_TOKENS = 1024


def _fits(rm, sizes, limit: float, **changes) -> bool:
    mesh = changes.get("mesh", rm.mesh)
    if not mesh.valid_for(sizes):
        return False
    return rm.with_changes(sizes, **changes).peak_gib <= limit


def _budget_fix(rm, sizes, limit: float, pass_name: str) -> str | None:
    """The largest token budget (halving) that fits, with the CP the longest sequence then needs."""
    key = "infer_tokens" if pass_name == "forward" and rm.trainable else "tokens_per_gpu"
    fixed_key = "infer_micro_batch_size" if key == "infer_tokens" else "micro_batch_size"
    fixed = getattr(rm, fixed_key)
    if fixed:  # use_dynamic_bsz=false: fewer sequences per micro-batch (the rows follow them)
        name, size = fixed
        while size > 1:
            size //= 2
            if _fits(rm, sizes, limit, **{fixed_key: (name, size)}):
                return f"{name}={size}"
        return None
    tokens = getattr(rm, key) or rm.tokens_per_gpu
    seq = rm.max_seq_len or tokens * rm.mesh.cp
    while tokens // 2 >= _MIN_TOKENS:
        tokens //= 2
        cp = rm.mesh.cp
        while tokens * cp < seq:
            cp *= 2
        mesh = dataclasses.replace(rm.mesh, cp=cp)
        if _fits(rm, sizes, limit, mesh=mesh, **{key: tokens}):
            where = BUDGET_KEYS[pass_name]  # the reference's budget is the forward one, like the actor's log-probs
            more = f" with ds4.mesh.cp={cp} (the longest sequence, {seq} tokens, needs budget x CP >= {seq})" if cp != rm.mesh.cp else ""
            return f"{where}={tokens}{more}"
    return None


def fixes(rm, sizes, limit: float, gpus_per_node: int, arch: str | None = None, dense_loss_on_sm90: bool = False) -> list[str]:
    """The smallest change in each direction that brings ``rm``'s peak to ``limit`` (may be empty)."""
    m, out = rm.mesh, []
    pass_name, _ = rm.peak
    budget = _budget_fix(rm, sizes, limit, pass_name)
    if budget:
        out.append(f"fewer tokens per GPU: {budget}")
    if rm.recompute is not None and rm.trainable and _fits(rm, sizes, limit, recompute=None):
        out.append("full recompute: ds4.recompute_granularity=full ds4.recompute_method=uniform ds4.recompute_num_layers=1")
    if rm.path == "unfused" and _fits(rm, sizes, limit, path="linear"):
        out.append("the memory-linear sparse attention: ds4.sparse_attention=linear")
    if rm.path != "fused" and arch in ("sm90", "sm100") and not dense_loss_on_sm90 and _fits(rm, sizes, limit, path="fused"):
        out.append("the fused attention kernel: ds4.dsa_kernel_backend=cudnn" + (" ds4.sparse_attention=megatron" if rm.path == "linear" else ""))
    for ep in sorted(d for d in range(m.ep + 1, sizes.n_routed_experts + 1) if sizes.n_routed_experts % d == 0):
        if _fits(rm, sizes, limit, mesh=dataclasses.replace(m, ep=ep)):
            out.append(f"EP={ep} (ds4.mesh.ep)")
            break
    for pp in range(m.pp + 1, sizes.num_layers + 1):
        if _fits(rm, sizes, limit, mesh=dataclasses.replace(m, pp=pp)):
            out.append(f"PP={pp} (ds4.mesh.pp)")
            break
    nodes = m.world // gpus_per_node
    for factor in range(2, _MAX_NODE_FACTOR + 1):
        bigger = dataclasses.replace(m, world=m.world * factor)
        if _fits(rm, sizes, limit, mesh=bigger):
            out.append(f"more GPUs: ds4.mesh.nnodes={nodes * factor} ({bigger.world} GPUs, same mesh; launcher NNODES)")
            break
    if rm.trainable:
        key = OPTIM_KEYS.get(rm.role, "optim")
        for percent in range(5, 101, 5):
            aware = dataclasses.replace(rm.optimizer, main_params_bytes=2, cpu_offload_fraction=percent / 100)
            if _fits(rm, sizes, limit, optimizer=aware):
                out.append(
                    f"Megatron's CPU optimizer offload: +{key}.override_optimizer_config.optimizer_cpu_offload=true "
                    f"+{key}.override_optimizer_config.optimizer_offload_fraction={percent / 100:g} "
                    f"{key}.use_precision_aware_optimizer=true (host RAM per GPU rises accordingly)"
                )
                break
    return out


def rollout_fixes(sizes, tp: int, quantization, share: float, gpus_per_node: int) -> list[str]:
    """The smallest rollout TP that fits with the current weights, and with FP8 weights."""
    out = []
    for quant in dict.fromkeys([quantization, "fp8"]):
        for bigger in (tp * 2**i for i in range(0, 7)):
            if (bigger, quant) != (tp, quantization) and rollout_weights_gib(sizes, bigger, quant) <= share:
                where = "" if bigger <= gpus_per_node else " (spans nodes: needs a multi-node rollout engine)"
                change = [f"ds4.rollout.tp={bigger}"] if bigger != tp else []
                change += ["ds4.rollout.quantization=fp8"] if quant != quantization else []
                out.append(" ".join(change) + where)
                break
    return out


def _plan_fit_hint(inputs: MemoryInputs, memory, rm) -> str:
    """The ``plan --fit`` command that searches meshes for this role's settings (model, GPU, recipe, budget,
    longest sequence, kernel path, recompute)."""
    gpu = f"--gpu {memory.hardware}" if memory.hardware in GPU_MEMORY_GIB else f"--gpu-memory-gib {memory.capacity_gib:g}"
    recompute = "full" if rm.recompute is None else ("selective" if rm.recompute else "none")
    seq = f" --max-seq-len {rm.max_seq_len}" if rm.max_seq_len else ""
    return (
        f"no single change fits; `verl-ds4 plan --fit --model {inputs.fit_model} {gpu} --gpus {inputs.world}-{16 * inputs.world} "
        f"--recipe {inputs.fit_recipe} --tokens-per-gpu {rm.tokens_per_gpu}{seq} --kernel {rm.path} --recompute {recompute}` lists "
        "the meshes that do."
    )


def describe_peak(rm) -> str:
    """``role (mesh) pass, stage S (L layers): peak P = states + activations + moment + margin`` (GiB per GPU)."""
    m = rm.mesh
    name, s = rm.peak
    tokens = rm.infer_tokens if name == "forward" and rm.trainable else rm.tokens_per_gpu
    recompute = "full" if rm.recompute is None else (",".join(sorted(rm.recompute)) or "none")
    return (
        f"{rm.role} (TP1/PP{m.pp}/EP{m.ep}/CP{m.cp}, DP x CP {m.dense_dp}, expert-DP {m.expert_dp}; {rm.path} attention, "
        f"recompute {recompute}, {tokens} tokens per GPU) {name} pass, stage {s.stage} ({s.layers} layers): peak "
        f"{s.peak_gib:.1f} GiB per GPU = states {s.static_gib:.1f} (weights {s.weights_gib:.1f} + grads {s.grads_gib:.1f} + "
        f"optimizer {s.optimizer_gib:.1f}) + activations {s.activations_gib:.1f} + {s.peak_detail} {s.transient_gib:.1f}"
        + (f" (logits {s.logits_gib:.1f})" if s.logits_gib else "") + f" + all-to-all and allocator margin {s.a2a_gib + s.margin_gib:.1f}"
    )


def _shorter_hint(inputs: MemoryInputs) -> str:
    """The length lever: a shorter ``ds4.max_seq_len`` (when it is set, it is what raised the budgets)."""
    if inputs.max_seq_len_knob is None:
        return ""
    return f" Or train shorter sequences: lower ds4.max_seq_len (now {inputs.max_seq_len_knob}; launcher MAX_SEQ_LEN)."


def findings(inputs: MemoryInputs, memory, arch: str | None = None,
             dense_loss_on_sm90: bool = False) -> tuple[list[Finding], list[Finding], list[str]]:
    """Problems (peaks over the limit, roles that do not fit together, the rollout, host RAM), warnings and notes
    (fills ``memory.phases``, ``memory.rollout`` and the host figures)."""
    problems, notes = [], []
    sizes = inputs.sizes
    cap, hw, limit = memory.capacity_gib, memory.hardware or "the GPU", memory.limit_gib
    for rm in memory.roles:
        if rm.peak_gib > limit:
            fix = fixes(rm, sizes, limit, inputs.gpus_per_node, arch, dense_loss_on_sm90)
            before = " (the states alone exceed it)" if rm.worst.static_gib > limit else ""
            problems.append(Finding(
                f"{rm.role} memory",
                f"{describe_peak(rm)} exceeds {limit:.1f} GiB, the {cap:.1f} GiB of one {hw} less the headroom "
                f"{memory.headroom:g} (ds4.memory_headroom){before}.",
                (("smallest changes that fit: " + "; ".join(fix)) if fix else _plan_fit_hint(inputs, memory, rm))
                + _shorter_hint(inputs),
            ))
    trainers = list(memory.roles)
    if len(trainers) > 1:  # verl colocates the roles on the same GPUs: every pass runs beside the others' resident states
        for rm in trainers:
            others = sum(o.resident_gib for o in trainers if o is not rm)
            for name, stages in rm.passes.items():
                own = peak_stage(stages).peak_gib
                total = own + others
                memory.phases.append((f"{rm.role} {name}", total))
                if total > limit and own <= limit:
                    problems.append(Finding(
                        f"{rm.role} {name}",
                        f"its peak {own:.1f} GiB plus {others:.1f} GiB the other roles keep on the GPU "
                        f"= {total:.1f} GiB exceed {limit:.1f} GiB (one {hw} less the headroom).",
                        "turn on verl's offload for the other roles: ds4.offload.param=true ds4.offload.optimizer=true.",
                    ))
    rollout = _rollout_findings(inputs, memory, problems)
    if rollout is not None:
        memory.phases.append(("rollout", rollout))
    host_problems, warnings = host_findings(inputs, memory)
    return problems + host_problems, warnings, notes


def _rollout_findings(inputs: MemoryInputs, memory, problems: list[Finding]) -> float | None:
    rollout, sizes = inputs.rollout, inputs.sizes
    if rollout is None:
        return None
    cap = memory.capacity_gib
    tp, quant, util = rollout.tp, rollout.quantization, rollout.utilization
    weights = rollout_weights_gib(sizes, tp, quant)
    memory.rollout = {"tp": tp, "quantization": quant, "utilization": util, "weights_gib": weights, "share_gib": util * cap}
    if weights > util * cap:
        fix = rollout_fixes(sizes, tp, quant, util * cap, inputs.gpus_per_node)
        problems.append(Finding(
            "rollout memory",
            f"{rollout.name} weights ({'fp8' if quant == 'fp8' else 'bf16'}, TP{tp}) {weights:.1f} GiB per GPU exceed "
            f"gpu_memory_utilization {util:g} x {cap:.1f} GiB = {util * cap:.1f} GiB, before any KV cache.",
            ("smallest changes that fit: " + "; ".join(fix)) if fix else "a larger rollout TP with FP8 weights over several nodes.",
        ))
    kv_cache_findings(inputs, memory, problems)
    resident = sum(rm.resident_gib for rm in memory.roles)
    if resident + util * cap > cap:
        problems.append(Finding(
            "rollout phase",
            f"the training roles keep {resident:.1f} GiB on each GPU during generation and the rollout takes "
            f"{util:g} x {cap:.1f} GiB: {resident + util * cap:.1f} GiB > {cap:.1f} GiB.",
            "turn on verl's offload (ds4.offload.param=true ds4.offload.optimizer=true) or lower ds4.rollout.gpu_memory_utilization.",
        ))
    return resident + util * cap
