"""Each role's memory on its passes, and the whole check: a function of :class:`~verl_ds4.memory.types.MemoryInputs`.

:func:`evaluate` computes, per role (:class:`~verl_ds4.memory.types.RoleInput`) and per GPU, what
:mod:`verl_ds4.memory.stages` says, and returns the :class:`MemoryReport` with the findings
(:class:`~verl_ds4.memory.types.Finding`) the recipe layer adds to its validation report
(:mod:`verl_ds4.recipes.memory_check`):

* a role whose *peak* on one of its passes (:mod:`verl_ds4.memory.peak`: states + activations for the recipe's
  attention kernel path and recompute + the peak moment + the all-to-all buffers + the allocator margin)
  exceeds the GPU less the headroom (``ds4.memory_headroom``, default 0.1: the same rule as ``plan --fit``),
  roles that share the GPUs (verl colocates actor, reference and critic) exceeding it together in one phase,
  rollout weights above vLLM's share (``gpu_memory_utilization``), a node's host RAM short
  (:mod:`.host`). Each names the role, the pass, the stage, the terms, the capacity and the smallest changes
  that fit (:mod:`.fixes`).

Colocation: a role's update holds all its states; every pass of a role (update and forward-only) runs
beside what the other roles keep on the GPU, which is what verl does not offload (``param_offload``:
weights and gradients; ``optimizer_offload``: optimizer states), and the rollout engine is asleep. During
generation the rollout takes ``gpu_memory_utilization`` of the GPU beside whatever the training roles keep resident.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verl_ds4.memory.fixes import findings
from verl_ds4.memory.kernels import GPU_ARCH
from verl_ds4.memory.micro_batches import micro_batches as count_micro_batches, static_rows
from verl_ds4.memory.peak import DEFAULT_HEADROOM
from verl_ds4.memory.stages import StageMemory, peak_stage, training_memory, worst_stage
from verl_ds4.memory.types import Finding, MemoryInputs, RoleInput

__all__ = ["MemoryReport", "RoleMemory", "evaluate", "role_memory"]


@dataclass(frozen=True)
class RoleMemory(RoleInput):
    """One role's settings (the fields of :class:`~verl_ds4.memory.types.RoleInput`) and its per-GPU figures (GiB):
    its passes (``update`` / ``forward``), each per pipeline stage (:func:`role_memory` computes them).

    ``update``: a training step (SFT, actor, critic) with every state on the GPU; ``forward``: a
    forward-only pass (actor log-probs, reference, critic values) with the weights, the gradient
    buffers of a trainable engine and its optimizer states unless verl offloads them."""

    stages: list[StageMemory] = field(default_factory=list)  # the update (or, for the reference, the forward) pass
    forward: list[StageMemory] = field(default_factory=list)  # the forward-only pass of a trainable role, or []

    def with_changes(self, sizes, **changes) -> "RoleMemory":
        """This role with other settings (``mesh``, ``optimizer``, ``tokens_per_gpu``, ``infer_tokens``,
        ``recompute``, ``path``, ``micro_batch_size``), its passes recomputed (for the fixes). A fixed-size pass's
        rows follow its micro-batch size, the longest sequence and the CP of the changed mesh."""
        rm = dataclasses.replace(self, **changes)
        seq = rm.max_seq_len or rm.tokens_per_gpu * rm.mesh.cp
        if rm.micro_batch_size and "tokens_per_gpu" not in changes:
            rm = dataclasses.replace(rm, tokens_per_gpu=static_rows(rm.micro_batch_size[1], seq, rm.mesh.cp))
        if rm.infer_micro_batch_size and "infer_tokens" not in changes:
            rm = dataclasses.replace(rm, infer_tokens=static_rows(rm.infer_micro_batch_size[1], seq, rm.mesh.cp))
        return role_memory(sizes, rm)

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


def _passes(sizes, rm: RoleMemory) -> tuple[list[StageMemory], list[StageMemory]]:
    """(the role's main pass, its forward-only pass or []) per pipeline stage."""
    common = dict(
        mtp=rm.mtp, value_head=rm.role == "critic", recompute=rm.recompute, path=rm.path, max_seq_len=rm.max_seq_len,
        dense_indexer_loss=rm.dense_indexer_loss, logits_kernel=rm.logits_kernel,
    )
    main = training_memory(
        sizes, rm.mesh, rm.optimizer, trainable=rm.trainable, tokens_per_gpu=rm.tokens_per_gpu,
        micro_batches=rm.micro_batches, logits_pass=rm.logits, **common,
    )
    forward = []
    if rm.trainable and rm.infer_tokens:
        forward = training_memory(
            sizes, rm.mesh, rm.optimizer, trainable=True, training=False, tokens_per_gpu=rm.infer_tokens,
            logits_pass="logprob" if rm.role == "actor" else None, **common,
        )
        if rm.optimizer_offload:  # verl loads the weights and gradient buffers for a forward, not the optimizer
            forward = [dataclasses.replace(s, optimizer_gib=0.0) for s in forward]
    return main, forward


def role_memory(sizes, settings: RoleInput) -> RoleMemory:
    """A role's memory from its settings, passes computed (the start-up check and ``plan --fit``)."""
    bare = RoleMemory(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(RoleInput)})
    stages, forward = _passes(sizes, bare)
    return dataclasses.replace(bare, stages=stages, forward=forward)


def evaluate(inputs: MemoryInputs) -> tuple[MemoryReport, list[Finding], list[Finding], list[str]]:
    """(the report, the findings that refuse the recipe, warnings, notes) of the inputs; an input marked
    ``skipped`` gives its report and nothing else."""
    memory = MemoryReport(mode=inputs.mode, capacity_gib=inputs.capacity_gib, hardware=inputs.hardware,
                          gpus_per_node=inputs.gpus_per_node, skipped=inputs.skipped, headroom=inputs.headroom)
    if inputs.skipped:
        return memory, [], [], []
    memory.roles = [role_memory(inputs.sizes, r) for r in inputs.roles]
    arch = GPU_ARCH.get(str(inputs.hardware))
    dense_sm90 = arch == "sm90" and any(rm.dense_indexer_loss for rm in memory.roles)
    found, warnings, notes = findings(inputs, memory, arch, dense_sm90)
    return memory, found, warnings, notes
