"""The start-up memory check of a composed DS4 recipe: a table per role, and a refusal when it cannot fit.

:func:`check_memory` reads the resolved config (meshes, optimizer settings, offload flags, token
budgets, the rollout) and the model's sizes, computes per role and per GPU what
:mod:`verl_ds4.memory.stages` says, and adds to the validation report:

* an **error** (``ds4.memory_check=error``, the default) when a role's *peak* on one of its passes
  (:mod:`verl_ds4.memory.peak`: states + activations for the recipe's attention kernel path and
  recompute + the peak moment + the all-to-all buffers + the allocator margin) exceeds the GPU less the
  headroom (``ds4.memory_headroom``, default 0.1: the same rule as ``plan --fit``), when the roles that
  share the GPUs (verl colocates actor, reference and critic) exceed it together in one phase, when the
  rollout's weights exceed vLLM's share (``gpu_memory_utilization``), or when a node's host RAM is
  short (:mod:`.host`). Each names the role, the pass, the stage, the terms, the capacity and the
  smallest changes that fit (:mod:`.fixes`);
* the same findings as **warnings** with ``ds4.memory_check=warn`` (and a line saying so), nothing
  with ``off`` (and a line saying the check is off).

Colocation: a role's update holds all its states; every pass of a role (update and forward-only) runs
beside what the other roles keep on the GPU, which is what verl does not offload (``param_offload``:
weights and gradients; ``optimizer_offload``: optimizer states), and the rollout engine is asleep. During generation the rollout takes ``gpu_memory_utilization`` of the
GPU beside whatever the training roles keep resident.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from verl_ds4.memory.stages import (
    OPTIM_KEYS, Mesh, OptimizerSettings, StageMemory, gpu_memory_gib, peak_stage, training_memory, worst_stage,
)
from verl_ds4.memory.peak import DEFAULT_HEADROOM, check_headroom, path_of
from verl_ds4.memory.kernels import GPU_ARCH, dense_indexer_loss
from verl_ds4.memory.fixes import findings
from verl_ds4.recipes.memory_inputs import pass_settings
from verl_ds4.memory.table import format_memory  # re-exported
from verl_ds4.memory.micro_batches import micro_batches as count_micro_batches, static_rows
from verl_ds4.recipes.roles import Problem, RoleMesh, _get

__all__ = ["MEMORY_CHECK_MODES", "RoleMemory", "MemoryReport", "check_memory", "format_memory", "optimizer_settings", "role_memory"]

MEMORY_CHECK_MODES = ("error", "warn", "off")
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "32": 4, "bf16": 2, "bfloat16": 2, "16": 2}


@dataclass
class RoleMemory:
    """One role's per-GPU figures (GiB): its passes (``update`` / ``forward``), each per pipeline stage.

    ``update``: a training step (SFT, actor, critic) with every state on the GPU; ``forward``: a
    forward-only pass (actor log-probs, reference, critic values) with the weights, the gradient
    buffers of a trainable engine and its optimizer states unless verl offloads them."""

    role: str
    mesh: Mesh
    stages: list[StageMemory]  # the update (or, for the reference, the forward) pass
    trainable: bool
    tokens_per_gpu: int
    param_offload: bool
    optimizer_offload: bool
    optimizer: OptimizerSettings
    mtp: bool = False
    recompute: frozenset[str] | None = frozenset({"moe_act", "mhc"})
    sequences: int | None = None  # sequences one update packs over all DP ranks (None: not bounded)
    path: str = "unfused"
    max_seq_len: int | None = None
    infer_tokens: int | None = None  # the forward pass's budget (None: no forward-only pass)
    logits: str = "sft"
    dense_indexer_loss: bool = False
    forward: list[StageMemory] = field(default_factory=list)
    # use_dynamic_bsz=false: the pass's micro_batch_size_per_gpu and its key (rows = size x longest / CP); else None
    micro_batch_size: tuple[str, int] | None = None
    infer_micro_batch_size: tuple[str, int] | None = None

    def with_changes(self, sizes, **changes) -> "RoleMemory":
        """This role with other settings (``mesh``, ``optimizer``, ``tokens_per_gpu``, ``infer_tokens``,
        ``recompute``, ``path``, ``micro_batch_size``), its passes recomputed (for the fixes). A fixed-size pass's
        rows follow its micro-batch size, the longest sequence and the CP of the changed mesh."""
        rm = dataclasses.replace(self, **changes)
        seq = rm.max_seq_len or rm.tokens_per_gpu * rm.mesh.cp
        if rm.micro_batch_size and "tokens_per_gpu" not in changes:
            rm.tokens_per_gpu = static_rows(rm.micro_batch_size[1], seq, rm.mesh.cp)
        if rm.infer_micro_batch_size and "infer_tokens" not in changes:
            rm.infer_tokens = static_rows(rm.infer_micro_batch_size[1], seq, rm.mesh.cp)
        rm.stages, rm.forward = _passes(sizes, rm)
        return rm

    @property
    def micro_batches(self) -> int | None:
        """One update's micro-batches per DP rank as verl makes them (:mod:`.micro_batches`: the sequences packed
        whole into budget x CP, or micro_batch_size_per_gpu at a time; a multiple of PP under vpp). It follows the
        mesh and the budget, so a lever that changes them changes it too."""
        m = self.mesh
        dp = m.world // (m.tp * m.pp * m.cp)
        if self.sequences is None or self.max_seq_len is None or dp < 1 or self.tokens_per_gpu < 1:
            return None
        return count_micro_batches(
            self.sequences, dp, self.max_seq_len, tokens_per_gpu=self.tokens_per_gpu, cp=m.cp,
            micro_batch_size=self.micro_batch_size[1] if self.micro_batch_size else None,
            group=(m.vp_group or m.pp) if (m.vpp or 1) > 1 else 1,
        )

    @property
    def passes(self) -> dict[str, list[StageMemory]]:
        out = {("update" if self.trainable else "forward"): self.stages}
        if self.forward:
            out["forward"] = self.forward
        return out

    @property
    def worst(self) -> StageMemory:
        """The stage with the most states (the update's)."""
        return worst_stage(self.stages)

    @property
    def peak(self) -> tuple[str, StageMemory]:
        """(pass, stage) of this role's highest peak."""
        return max(((name, peak_stage(stages)) for name, stages in self.passes.items()), key=lambda x: x[1].peak_gib)

    @property
    def peak_gib(self) -> float:
        return self.peak[1].peak_gib

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
    gpus_per_node: int = 1
    skipped: str | None = None
    headroom: float = DEFAULT_HEADROOM
    host: dict[str, float] = field(default_factory=dict)  # host RAM per node: what -> GiB
    host_capacity_gib: float | None = None

    @property
    def limit_gib(self) -> float:
        """What a role's peak may reach: the GPU less the headroom."""
        return (1 - self.headroom) * (self.capacity_gib or 0.0)

    def as_dict(self) -> dict[str, Any]:
        """The machine-readable summary (``verl-ds4 recipe NAME --dry-run --json``)."""
        out: dict[str, Any] = {"check": self.mode, "skipped": self.skipped, "hardware": self.hardware,
                               "gpu_gib": self.capacity_gib, "headroom": self.headroom, "roles": {}}
        if self.skipped:
            return out
        out["limit_gib"] = round(self.limit_gib, 2)
        for rm in self.roles:
            name, stage = rm.peak
            out["roles"][rm.role] = {
                "mesh": {"pp": rm.mesh.pp, "ep": rm.mesh.ep, "cp": rm.mesh.cp, "dp_x_cp": rm.mesh.dense_dp, "expert_dp": rm.mesh.expert_dp},
                "attention_kernel": rm.path, "recompute": "full" if rm.recompute is None else sorted(rm.recompute),
                "tokens_per_gpu": rm.tokens_per_gpu, "micro_batches": rm.micro_batches, "pass": name, "stage": stage.stage,
                "states_gib": round(stage.static_gib, 2), "activations_gib": round(stage.activations_gib, 2),
                "transient_gib": round(stage.transient_gib, 2),
                "logits_gib": round(stage.logits_gib, 2),  # the peak stage's, like the fields around it
                "logits_gib_max": round(max(s.logits_gib for stages in rm.passes.values() for s in stages), 2),  # last stage
                "a2a_gib": round(stage.a2a_gib, 2), "margin_gib": round(stage.margin_gib, 2),
                "peak_gib": round(stage.peak_gib, 2), "peak_moment": stage.peak_detail,
                "fits": stage.peak_gib <= self.limit_gib,
                "passes": {n: round(peak_stage(s).peak_gib, 2) for n, s in rm.passes.items()},
            }
        if self.rollout:
            out["rollout"] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in self.rollout.items()}
        out["host"] = {"per_node_gib": {k: round(v, 1) for k, v in self.host.items()},
                       "total_gib": round(sum(self.host.values()), 1), "capacity_gib": self.host_capacity_gib}
        return out


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


def recompute_of(engine: Any) -> frozenset[str] | None:
    """Recomputed modules of an engine block (``None``: full recompute, only layer inputs kept)."""
    otc = engine.get("override_transformer_config") or {}
    granularity = otc.get("recompute_granularity")
    if granularity == "full":
        return None
    if granularity == "selective":
        return frozenset(str(m) for m in (otc.get("recompute_modules") or []))
    return frozenset()


def attention_path_of(engine: Any) -> str:
    """The DS4 attention kernel path an engine block runs: Megatron's default backend is unfused, and with the
    engine's ``sparse_attention: linear`` (recipe knob ``ds4.sparse_attention``) it runs verl-ds4's linear core."""
    otc = engine.get("override_transformer_config") or {}
    return path_of(otc.get("dsa_kernel_backend"), engine.get("sparse_attention"))


def _logits_kind(cfg: DictConfig, role: str) -> str:
    if role == "sft":
        return "sft"
    if role == "critic":
        return "value"
    if role == "ref":
        return "ref"
    entropy = float(_get(cfg, "actor_rollout_ref.actor.entropy_coeff", 0.0) or 0.0)
    return "actor" if entropy != 0.0 or bool(_get(cfg, "actor_rollout_ref.actor.calculate_entropy", False)) else "sft"


def role_memory(sizes, role: str, mesh: Mesh, **settings) -> RoleMemory:
    """A role's memory from its settings (the :class:`RoleMemory` fields), passes computed (``plan --fit``)."""
    rm = RoleMemory(role=role, mesh=mesh, stages=[], **settings)
    rm.stages, rm.forward = _passes(sizes, rm)
    return rm


def _role_memory(cfg: DictConfig, role: RoleMesh, sizes, world: int, max_seq_len: int, problems: list[Problem]) -> RoleMemory:
    engine = _get(cfg, role.engine_key) or {}
    otc = engine.get("override_transformer_config") or {}
    group = otc.get("microbatch_group_size_per_vp_stage")
    mesh = Mesh(world=world, pp=role.pp, ep=role.ep, cp=role.cp, etp=role.etp, tp=role.tp, vpp=role.vpp,
                vp_group=int(group) if group else None)
    trainable = role.role != "ref"
    optim = optimizer_settings(cfg, role, problems) if trainable else OptimizerSettings()
    passes = pass_settings(cfg, role.role, max_seq_len, role.cp, problems)  # each pass's rows, dynamic or fixed-size
    main = passes.get("update" if trainable else "forward")
    fwd = passes.get("forward") if trainable else None
    tokens = main.tokens if main else max_seq_len
    infer = fwd.tokens if fwd else None
    mtp = role.mtp and role.role != "critic"
    dense_loss = dense_indexer_loss(otc)
    rm = RoleMemory(
        role=role.role, mesh=mesh, stages=[], trainable=trainable, tokens_per_gpu=tokens,
        param_offload=bool(engine.get("param_offload", False)), optimizer_offload=bool(engine.get("optimizer_offload", False)),
        optimizer=optim, mtp=mtp, recompute=recompute_of(engine), sequences=_update_sequences(cfg, role),
        path=attention_path_of(engine), max_seq_len=max_seq_len, infer_tokens=infer, logits=_logits_kind(cfg, role.role),
        dense_indexer_loss=dense_loss,
        micro_batch_size=(main.key, main.micro_batch_size) if main and main.micro_batch_size else None,
        infer_micro_batch_size=(fwd.key, fwd.micro_batch_size) if fwd and fwd.micro_batch_size else None,
    )
    rm.stages, rm.forward = _passes(sizes, rm)
    return rm


def _update_sequences(cfg: DictConfig, role: RoleMesh) -> int | None:
    """The sequences one update packs (SFT: the batch; actor / critic: the mini-batch x n), None for others."""
    if role.role == "sft":
        sequences = _get(cfg, "data.train_batch_size")
    elif role.role in ("actor", "critic"):
        key = "actor_rollout_ref.actor" if role.role == "actor" else "critic"
        sequences = _get(cfg, f"{key}.ppo_mini_batch_size")
        sequences = None if sequences is None else int(sequences) * int(_get(cfg, "actor_rollout_ref.rollout.n", 1))
    else:
        return None
    return None if sequences is None else int(sequences)


def _passes(sizes, rm: RoleMemory) -> tuple[list[StageMemory], list[StageMemory]]:
    """(the role's main pass, its forward-only pass or []) per pipeline stage."""
    common = dict(
        mtp=rm.mtp, value_head=rm.role == "critic", recompute=rm.recompute, path=rm.path, max_seq_len=rm.max_seq_len,
        dense_indexer_loss=rm.dense_indexer_loss,
    )
    main = training_memory(
        sizes, rm.mesh, rm.optimizer, trainable=rm.trainable, tokens_per_gpu=rm.tokens_per_gpu,
        micro_batches=rm.micro_batches, logits_kind=rm.logits, **common,
    )
    forward = []
    if rm.trainable and rm.infer_tokens:
        forward = training_memory(
            sizes, rm.mesh, rm.optimizer, trainable=True, training=False, tokens_per_gpu=rm.infer_tokens,
            logits_kind="logprob" if rm.role == "actor" else None, **common,
        )
        if rm.optimizer_offload:  # verl loads the weights and gradient buffers for a forward, not the optimizer
            forward = [dataclasses.replace(s, optimizer_gib=0.0) for s in forward]
    return main, forward


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
        memory.skipped = "ds4.memory_check=off: whether the peak fits on the GPUs was NOT checked"
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
    headroom = _get(cfg, "ds4.memory_headroom", DEFAULT_HEADROOM)
    try:
        memory.headroom = check_headroom(float(headroom))
    except (TypeError, ValueError) as e:
        report.errors.append(Problem("ds4.memory_headroom", str(e), "set ds4.memory_headroom to a fraction such as 0.1 (the default)."))
        memory.skipped = "ds4.memory_headroom is invalid"
        return memory
    problems: list[Problem] = []
    world = report.world_size
    memory.roles = [
        _role_memory(cfg, r, sizes, world, report.max_seq_len, problems)
        for r in report.roles
        if min(r.tp, r.pp, r.cp, r.ep, r.etp) >= 1 and Mesh(world, r.pp, r.ep, r.cp, r.etp, r.tp).valid_for(sizes)
    ]
    report.errors.extend(problems)
    arch = GPU_ARCH.get(str(hardware))
    dense_sm90 = arch == "sm90" and any(rm.dense_indexer_loss for rm in memory.roles)
    found, notes = findings(cfg, report, memory, sizes, arch, dense_sm90)
    if mode == "warn" and found:
        report.warnings.extend(Problem(p.setting, p.message + " (ds4.memory_check=warn: not refused)", p.fix) for p in found)
        report.notes.append(f"ds4.memory_check=warn: {len(found)} memory finding(s) reported as warnings; the run is NOT refused.")
    else:
        report.errors.extend(found)
    report.notes.extend(notes)
    return memory
