"""The start-up memory check of a composed DS4 recipe: a table per role, and a refusal when it cannot fit.

:func:`check_memory` reads the resolved config (meshes, optimizer settings, offload flags, token
budgets, the rollout) and the model's sizes, computes per role and per GPU what
:mod:`verl_ds4.recipes.memory` says, and adds to the validation report:

* an **error** (``ds4.memory_check=error``, the default) when a role's weights + gradients +
  optimizer states on its worst pipeline stage exceed the GPU, when the roles that share the GPUs
  (verl colocates actor, reference and critic) exceed it together in one phase, or when the
  rollout's weights exceed vLLM's share (``gpu_memory_utilization``). Each names the role, the
  stage, the figure, the capacity and the smallest changes that fit (:mod:`.memory_fixes`);
* the same findings as **warnings** with ``ds4.memory_check=warn`` (and a line saying so), nothing
  with ``off`` (and a line saying the check is off);
* a **note** when the activation *estimate* on top of the states exceeds the GPU (an estimate:
  its assumptions are in :mod:`verl_ds4.recipes.memory`).

Colocation: a role's update holds all its states; the other roles keep on the GPU what verl does
not offload (``param_offload``: weights and gradients; ``optimizer_offload``: optimizer states) and
the rollout engine is asleep. During generation the rollout takes ``gpu_memory_utilization`` of the
GPU beside whatever the training roles keep resident.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from verl_ds4.recipes.memory import (
    OPTIM_KEYS, Mesh, OptimizerSettings, StageMemory, gpu_memory_gib, training_memory, worst_stage,
)
from verl_ds4.recipes.memory_fixes import findings
from verl_ds4.recipes.roles import Problem, RoleMesh, _get

__all__ = ["MEMORY_CHECK_MODES", "RoleMemory", "MemoryReport", "check_memory", "optimizer_settings"]

MEMORY_CHECK_MODES = ("error", "warn", "off")
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "32": 4, "bf16": 2, "bfloat16": 2, "16": 2}


@dataclass
class RoleMemory:
    """One role's per-GPU figures (GiB) on its worst stage, and what it keeps resident when idle."""

    role: str
    mesh: Mesh
    stages: list[StageMemory]
    trainable: bool
    tokens_per_gpu: int
    param_offload: bool
    optimizer_offload: bool
    optimizer: OptimizerSettings
    mtp: bool = False
    recompute: frozenset[str] | None = frozenset({"moe_act", "mhc"})
    micro_batches: int | None = None

    def recompute_stages(self, sizes, mesh: Mesh, optimizer: OptimizerSettings | None = None) -> list[StageMemory]:
        """This role's stages on another ``mesh`` / ``optimizer`` (for the fixes)."""
        return _stages(sizes, mesh, optimizer or self.optimizer, self.trainable, self.mtp, self.role == "critic",
                       self.tokens_per_gpu, self.recompute, self.micro_batches)

    @property
    def worst(self) -> StageMemory:
        return worst_stage(self.stages)

    @property
    def peak_estimate_gib(self) -> float:
        """States + activation estimate, on the stage where that sum is largest."""
        return max(s.total_gib for s in self.stages)

    @property
    def resident_gib(self) -> float:
        """What stays on the GPU while another role runs (verl's offload flags)."""
        w = self.worst
        return (0.0 if self.param_offload else w.weights_gib + w.grads_gib) + (0.0 if self.optimizer_offload else w.optimizer_gib)

    @property
    def offloaded_host_gib(self) -> float:
        """Host memory per GPU: verl's offloaded states plus Megatron's CPU optimizer share."""
        w = self.worst
        return (w.weights_gib + w.grads_gib if self.param_offload else 0.0) + (
            w.optimizer_gib if self.optimizer_offload else 0.0
        ) + w.host_gib


@dataclass
class MemoryReport:
    mode: str
    capacity_gib: float | None = None
    hardware: str | None = None
    roles: list[RoleMemory] = field(default_factory=list)
    rollout: dict[str, Any] | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)
    host_gib_per_node: float = 0.0
    gpus_per_node: int = 1
    skipped: str | None = None


def _dtype_bytes(value: Any, key: str, problems: list[Problem]) -> int:
    text = str(value).replace("torch.", "")
    if text not in _DTYPE_BYTES:
        problems.append(Problem(key, f"is {value!r}; expected fp32 or bf16.", f"set {key} to fp32 or bf16."))
        return 4
    return _DTYPE_BYTES[text]


def optimizer_settings(cfg: DictConfig, role: RoleMesh, problems: list[Problem]) -> OptimizerSettings:
    """Megatron's gradient and Adam-state storage for ``role`` as verl will configure it."""
    key = OPTIM_KEYS.get(role.role)
    optim = _get(cfg, key) if key else None
    engine = _get(cfg, role.engine_key) or {}
    distributed = bool(engine.get("use_distributed_optimizer", True))
    if optim is None:
        return OptimizerSettings(distributed=distributed)
    override = optim.get("override_optimizer_config") or {}
    aware = bool(override.get("use_precision_aware_optimizer", optim.get("use_precision_aware_optimizer", False)))
    grads = params = m = v = 4
    if aware:
        grads = _dtype_bytes(override.get("main_grads_dtype", optim.get("main_grads_dtype", "fp32")), f"{key}.main_grads_dtype", problems)
        m = _dtype_bytes(override.get("exp_avg_dtype", optim.get("exp_avg_dtype", "fp32")), f"{key}.exp_avg_dtype", problems)
        v = _dtype_bytes(override.get("exp_avg_sq_dtype", optim.get("exp_avg_sq_dtype", "fp32")), f"{key}.exp_avg_sq_dtype", problems)
        remainders = bool(override.get("store_param_remainders", True))
        main = _dtype_bytes(override.get("main_params_dtype", "fp32"), f"{key}.override_optimizer_config.main_params_dtype", problems)
        params = 2 if (remainders and main == 4) else main
    fraction = 0.0
    if bool(override.get("optimizer_cpu_offload", False)):
        fraction = float(override.get("optimizer_offload_fraction", 0.0) or 0.0)
        if not 0.0 <= fraction <= 1.0:
            problems.append(
                Problem(f"{key}.override_optimizer_config.optimizer_offload_fraction", f"is {fraction}; expected 0..1.",
                        "set a fraction between 0 and 1 (1.0 keeps the whole optimizer on the host).")
            )
            fraction = min(max(fraction, 0.0), 1.0)
    return OptimizerSettings(distributed, grads, params, m, v, fraction)


def _recompute(engine: Any) -> frozenset[str] | None:
    """Recomputed modules (``None``: full recompute, only layer inputs kept)."""
    otc = engine.get("override_transformer_config") or {}
    granularity = otc.get("recompute_granularity")
    if granularity == "full":
        return None
    if granularity == "selective":
        return frozenset(str(m) for m in (otc.get("recompute_modules") or []))
    return frozenset()


def _role_memory(cfg: DictConfig, role: RoleMesh, sizes, world: int, max_seq_len: int, problems: list[Problem]) -> RoleMemory:
    engine = _get(cfg, role.engine_key) or {}
    mesh = Mesh(world=world, pp=role.pp, ep=role.ep, cp=role.cp, etp=role.etp, tp=role.tp)
    trainable = role.role != "ref"
    optim = optimizer_settings(cfg, role, problems) if trainable else OptimizerSettings()
    tokens = role.budgets[0].tokens_per_gpu if role.budgets else max_seq_len
    recompute = _recompute(engine)
    mtp = role.mtp and role.role != "critic"
    micro = _micro_batches(cfg, role, mesh, tokens, max_seq_len)
    return RoleMemory(
        role=role.role, mesh=mesh, stages=_stages(sizes, mesh, optim, trainable, mtp, role.role == "critic", tokens, recompute, micro),
        trainable=trainable, tokens_per_gpu=tokens, param_offload=bool(engine.get("param_offload", False)),
        optimizer_offload=bool(engine.get("optimizer_offload", False)), optimizer=optim, mtp=mtp, recompute=recompute,
        micro_batches=micro,
    )


def _micro_batches(cfg: DictConfig, role: RoleMesh, mesh: Mesh, tokens: int, max_seq_len: int) -> int | None:
    """An upper bound on one update's micro-batches per DP rank: sequences x longest / packed budget."""
    if role.role == "sft":
        sequences = _get(cfg, "data.train_batch_size")
    elif role.role in ("actor", "critic"):
        key = "actor_rollout_ref.actor" if role.role == "actor" else "critic"
        sequences = _get(cfg, f"{key}.ppo_mini_batch_size")
        sequences = None if sequences is None else int(sequences) * int(_get(cfg, "actor_rollout_ref.rollout.n", 1))
    else:
        return None
    dp = mesh.world // (mesh.tp * mesh.pp * mesh.cp)
    if sequences is None or dp < 1 or tokens < 1 or not role.budgets:
        return None
    per_rank = -(-int(sequences) // dp)
    return max(1, -(-(per_rank * max_seq_len) // (tokens * mesh.cp)))


def _stages(sizes, mesh, optim, trainable, mtp, value_head, tokens, recompute, micro=None) -> list[StageMemory]:
    stages = training_memory(
        sizes, mesh, optim, trainable=trainable, mtp=mtp, value_head=value_head, tokens_per_gpu=tokens,
        recompute=recompute if recompute is not None else frozenset({"moe_act", "mhc"}), micro_batches=micro,
    )
    if recompute is None:  # full recompute: about one layer's activations live, not every layer's
        stages = [dataclasses.replace(s, activations_gib=s.activations_gib / max(s.layers, 1)) for s in stages]
    return stages


def check_memory(cfg: DictConfig, report) -> MemoryReport:
    """Add the memory findings of the composed recipe to ``report`` (a ``ValidationReport``)."""
    mode = str(_get(cfg, "ds4.memory_check", "error"))
    if mode not in MEMORY_CHECK_MODES:
        report.errors.append(
            Problem("ds4.memory_check", f"is {mode!r}; expected one of {list(MEMORY_CHECK_MODES)}.", "set ds4.memory_check=error (default), warn or off.")
        )
        return MemoryReport(mode="error", skipped="ds4.memory_check has an unknown value")
    memory = MemoryReport(mode=mode, gpus_per_node=report.gpus_per_node)
    if mode == "off":
        memory.skipped = "ds4.memory_check=off: whether the states fit on the GPUs was NOT checked"
        report.warnings.append(Problem("ds4.memory_check", "is off: the memory check was skipped.", "set ds4.memory_check=error to check."))
        return memory
    sizes = report.facts.sizes
    if sizes is None:
        memory.skipped = report.facts.sizes_missing
        report.warnings.append(Problem("ds4.model", f"memory not checked: {report.facts.sizes_missing}", "add the missing field."))
        return memory
    hardware, explicit = _get(cfg, "ds4.mesh.hardware"), _get(cfg, "ds4.mesh.gpu_memory_gib")
    try:
        memory.capacity_gib, memory.hardware = gpu_memory_gib(hardware, explicit), hardware
    except ValueError as e:
        report.errors.append(Problem("ds4.mesh.hardware", str(e), "name known hardware or give ds4.mesh.gpu_memory_gib."))
        memory.skipped = "unknown GPU capacity"
        return memory
    problems: list[Problem] = []
    world = report.world_size
    memory.roles = [
        _role_memory(cfg, r, sizes, world, report.max_seq_len, problems)
        for r in report.roles
        if min(r.tp, r.pp, r.cp, r.ep, r.etp) >= 1 and Mesh(world, r.pp, r.ep, r.cp, r.etp, r.tp).valid_for(sizes)
    ]
    report.errors.extend(problems)
    found, notes = findings(cfg, report, memory, sizes)
    if mode == "warn" and found:
        report.warnings.extend(Problem(p.setting, p.message + " (ds4.memory_check=warn: not refused)", p.fix) for p in found)
        report.notes.append(f"ds4.memory_check=warn: {len(found)} memory finding(s) reported as warnings; the run is NOT refused.")
    else:
        report.errors.extend(found)
    report.notes.extend(notes)
    return memory


def format_memory(memory: MemoryReport | None) -> list[str]:
    """The memory table the plan prints (one line per role, then the rollout, the phases, host RAM)."""
    if memory is None:
        return []
    if memory.skipped:
        return [f"memory  : not checked ({memory.skipped})"]
    cap = memory.capacity_gib
    lines = [
        f"memory per GPU (GiB) on {memory.hardware} ({cap:.1f} GiB each; check: {memory.mode}); worst pipeline stage; "
        "states = weights + grads + optimizer; act. = activation estimate (verl_ds4/recipes/memory.py):"
    ]
    rows = [["role", "mesh", "stage", "layers", "weights", "grads", "optimizer", "states", "act. est.", "tokens/GPU",
             "micro-batches", "peak est.", "states fit"]]
    for rm in memory.roles:
        w, m = rm.worst, rm.mesh
        rows.append([
            rm.role, f"PP{m.pp}/EP{m.ep}/CP{m.cp} DPxCP {m.dense_dp} eDP {m.expert_dp}", str(w.stage), str(w.layers),
            f"{w.weights_gib:.1f}", f"{w.grads_gib:.1f}", f"{w.optimizer_gib:.1f}", f"{w.static_gib:.1f}",
            f"{max(s.activations_gib for s in rm.stages):.1f}", str(rm.tokens_per_gpu),
            "-" if not rm.trainable else f"<= {rm.micro_batches or m.pp}", f"{rm.peak_estimate_gib:.1f}",
            "yes" if w.static_gib <= cap else "NO",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    for rm in memory.roles:
        if rm.optimizer.cpu_offload_fraction:
            lines.append(f"  {rm.role}: Megatron CPU optimizer offload {rm.optimizer.cpu_offload_fraction:g} of the optimizer states")
    if memory.rollout:
        r = memory.rollout
        ok = r["weights_gib"] <= r["share_gib"]
        lines.append(
            f"  rollout: TP{r['tp']} {'fp8' if r['quantization'] == 'fp8' else 'bf16'} weights {r['weights_gib']:.1f} GiB per GPU "
            f"of a {r['utilization']:g} x {cap:.1f} = {r['share_gib']:.1f} GiB share: {'fits' if ok else 'does NOT fit'}"
        )
    if memory.phases:
        lines.append("  colocated phases (states on the GPU): " + ", ".join(f"{n} {v:.1f}" for n, v in memory.phases))
    if memory.host_gib_per_node:
        lines.append(f"  host RAM per node for offloaded states: {memory.host_gib_per_node:.0f} GiB ({memory.gpus_per_node} GPUs)")
    return lines
