"""What does not fit, and the smallest changes that do (the refusals of the memory check).

:func:`findings` turns a :class:`~verl_ds4.recipes.memory_check.MemoryReport` into problems (role,
stage, figure, capacity, fixes) and notes; :func:`fixes` searches, for one role whose states do not
fit, the smallest change in each direction that makes them fit: more GPUs (nodes), a larger EP, PP
or CP, Megatron's CPU optimizer offload (with the precision-aware optimizer it needs). The rollout's
fixes are a larger TP or FP8 weights. Every candidate is recomputed with the same memory model.
"""

from __future__ import annotations

import dataclasses

from verl_ds4.recipes.memory import OPTIM_KEYS, Mesh, rollout_weights_gib, worst_stage
from verl_ds4.recipes.roles import Problem, _get

__all__ = ["findings", "fixes", "rollout_fixes"]

_MAX_NODE_FACTOR = 16


def _fits(rm, sizes, mesh: Mesh, capacity: float, optimizer=None) -> bool:
    return mesh.valid_for(sizes) and worst_stage(rm.recompute_stages(sizes, mesh, optimizer)).static_gib <= capacity


def fixes(rm, sizes, capacity: float, gpus_per_node: int) -> list[str]:
    """The smallest change in each direction that makes ``rm``'s worst-stage states fit (may be empty)."""
    m, out = rm.mesh, []
    nodes = m.world // gpus_per_node
    for factor in range(2, _MAX_NODE_FACTOR + 1):
        bigger = dataclasses.replace(m, world=m.world * factor)
        if _fits(rm, sizes, bigger, capacity):
            out.append(f"more GPUs: ds4.mesh.nnodes={nodes * factor} ({bigger.world} GPUs, same mesh; launcher NNODES)")
            break
    for ep in sorted(d for d in range(m.ep + 1, sizes.n_routed_experts + 1) if sizes.n_routed_experts % d == 0):
        if _fits(rm, sizes, dataclasses.replace(m, ep=ep), capacity):
            out.append(f"EP={ep} (ds4.mesh.ep)")
            break
    for pp in range(m.pp + 1, sizes.num_layers + 1):
        if _fits(rm, sizes, dataclasses.replace(m, pp=pp), capacity):
            out.append(f"PP={pp} (ds4.mesh.pp)")
            break
    for cp in (2, 4, 8, 16):
        if cp > m.cp and _fits(rm, sizes, dataclasses.replace(m, cp=cp), capacity):
            out.append(f"CP={cp} (ds4.mesh.cp; shards the dense optimizer states further)")
            break
    if rm.trainable:
        key = OPTIM_KEYS.get(rm.role, "optim")
        for percent in range(5, 101, 5):
            aware = dataclasses.replace(rm.optimizer, main_params_bytes=2, cpu_offload_fraction=percent / 100)
            if _fits(rm, sizes, m, capacity, aware):
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


def _plan_fit_hint(report, memory) -> str:
    model = report.facts.name.split("-")[-1].lower() if report.facts.source.startswith("recipe") else report.facts.source
    return (
        "no single change fits; `verl-ds4 plan --fit --model "
        f"{model} --gpu {memory.hardware or '<GPU>'} --gpus {report.world_size}-{16 * report.world_size}` lists the meshes that do."
    )


def _describe(stage, role, mesh: Mesh) -> str:
    return (
        f"{role} (TP1/PP{mesh.pp}/EP{mesh.ep}/CP{mesh.cp}, DP x CP {mesh.dense_dp}, expert-DP {mesh.expert_dp}) "
        f"stage {stage.stage} ({stage.layers} layers): weights {stage.weights_gib:.1f} + grads {stage.grads_gib:.1f} + "
        f"optimizer {stage.optimizer_gib:.1f} = {stage.static_gib:.1f} GiB per GPU"
    )


def findings(cfg, report, memory, sizes) -> tuple[list[Problem], list[str]]:
    """Problems (states that cannot fit) and notes (activation estimates, host RAM) of ``memory``."""
    problems, notes = [], []
    cap, hw = memory.capacity_gib, memory.hardware or "the GPU"
    for rm in memory.roles:
        w = rm.worst
        if w.static_gib > cap:
            fix = fixes(rm, sizes, cap, report.gpus_per_node)
            problems.append(Problem(
                f"{rm.role} memory",
                f"{_describe(w, rm.role, rm.mesh)} exceeds the {cap:.1f} GiB of one {hw} before any activation.",
                ("smallest changes that fit: " + "; ".join(fix)) if fix else _plan_fit_hint(report, memory),
            ))
        elif rm.peak_estimate_gib > cap:
            notes.append(
                f"{rm.role}: states {w.static_gib:.1f} GiB + activation estimate at {rm.tokens_per_gpu} tokens/GPU "
                f"= {rm.peak_estimate_gib:.1f} GiB > {cap:.1f} GiB (an upper estimate, see verl_ds4/recipes/memory.py): "
                "lower the token budget or raise PP if it runs out of memory."
            )
    trainers = [rm for rm in memory.roles]
    if len(trainers) > 1:  # verl colocates the roles on the same GPUs
        for rm in trainers:
            if not rm.trainable:
                continue
            others = sum(o.resident_gib for o in trainers if o is not rm)
            total = rm.worst.static_gib + others
            memory.phases.append((f"{rm.role} update", total))
            if total > cap and rm.worst.static_gib <= cap:
                problems.append(Problem(
                    f"{rm.role} update",
                    f"its states {rm.worst.static_gib:.1f} GiB plus {others:.1f} GiB the other roles keep on the GPU "
                    f"= {total:.1f} GiB exceed the {cap:.1f} GiB of one {hw}.",
                    "turn on verl's offload for the other roles: ds4.offload.param=true ds4.offload.optimizer=true.",
                ))
    rollout = _rollout_findings(cfg, sizes, memory, report, problems)
    if rollout is not None:
        memory.phases.append(("rollout", rollout))
    memory.host_gib_per_node = report.gpus_per_node * sum(rm.offloaded_host_gib for rm in memory.roles)
    return problems, notes


def _rollout_findings(cfg, sizes, memory, report, problems) -> float | None:
    rollout = _get(cfg, "actor_rollout_ref.rollout")
    if rollout is None:
        return None
    cap = memory.capacity_gib
    tp = int(rollout.get("tensor_model_parallel_size") or 1)
    quant = rollout.get("quantization")
    util = float(rollout.get("gpu_memory_utilization") or 0.5)
    weights = rollout_weights_gib(sizes, tp, quant)
    memory.rollout = {"tp": tp, "quantization": quant, "utilization": util, "weights_gib": weights, "share_gib": util * cap}
    if weights > util * cap:
        fix = rollout_fixes(sizes, tp, quant, util * cap, report.gpus_per_node)
        problems.append(Problem(
            "rollout memory",
            f"{rollout.get('name')} weights ({'fp8' if quant == 'fp8' else 'bf16'}, TP{tp}) {weights:.1f} GiB per GPU exceed "
            f"gpu_memory_utilization {util:g} x {cap:.1f} GiB = {util * cap:.1f} GiB, before any KV cache.",
            ("smallest changes that fit: " + "; ".join(fix)) if fix else "a larger rollout TP with FP8 weights over several nodes.",
        ))
    resident = sum(rm.resident_gib for rm in memory.roles)
    if resident + util * cap > cap:
        problems.append(Problem(
            "rollout phase",
            f"the training roles keep {resident:.1f} GiB on each GPU during generation and the rollout takes "
            f"{util:g} x {cap:.1f} GiB: {resident + util * cap:.1f} GiB > {cap:.1f} GiB.",
            "turn on verl's offload (ds4.offload.param=true ds4.offload.optimizer=true) or lower ds4.rollout.gpu_memory_utilization.",
        ))
    return resident + util * cap
