"""Which meshes fit at peak: every TP=1 mesh (PP, EP, CP, DP) of a GPU count whose roles' peaks stay under the GPU.

    from verl_ds4.memory.fit import find_meshes
    rows = find_meshes(sizes, capacity_gib=139.8, gpu_counts=[64], recipe="sft", tokens_per_gpu=4096)
    [r for r in rows if r.fits]

Each row is one (PP, EP) pair at the smallest CP that holds the longest sequence (``tokens_per_gpu x
CP >= max_seq_len``; a larger CP that divides DP x CP is listed with it: it changes a GPU's peak only
through the all-gathered compressed KV). For each role the recipe builds (SFT: one engine; PPO: actor,
reference, critic; GRPO: actor, reference) the peak of each pass (:mod:`verl_ds4.memory.peak`) on its
highest stage. A mesh *fits* when every role's peak is at most ``(1 - headroom)`` of the GPU (the start-up
check's rule, :data:`verl_ds4.memory.peak.DEFAULT_HEADROOM`); ``check_activations=False`` judges the
states alone (the old rule, for comparison). Rows are ranked: meshes that fit first, then fewest GPUs,
then the lowest peak. For the best rows that do not fit, :func:`verl_ds4.memory.fixes.fixes`
lists the levers (tokens per GPU with the CP it then needs, recompute, the linear or fused kernel, EP, PP, more
GPUs, optimizer offload) that bring the worst role under the limit. For the RL recipes the rollout is reported
at the smallest TP (from one node up) whose weights and the KV cache of one sequence of the longest length fit
vLLM's share, bf16 first, then FP8, with the number of such sequences one engine holds at once
(:class:`RolloutFit`; a recipe whose ``max_num_seqs`` or batch asks for more is refused at start-up, with levers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_ds4.memory.fixes import fixes
from verl_ds4.memory.peak import DEFAULT_HEADROOM, check_headroom
from verl_ds4.memory.roles import role_memory
from verl_ds4.memory.rollout import kv_cache_gib
from verl_ds4.memory.stages import StageMemory, rollout_weights_gib
from verl_ds4.memory.types import Mesh, OptimizerSettings, RoleInput
from verl_ds4.models.ds4.sizes import DS4Sizes

__all__ = ["MeshFit", "RolloutFit", "find_meshes", "DEFAULT_HEADROOM", "PP_CHOICES", "CP_CHOICES", "ROLES"]

PP_CHOICES = (1, 2, 4, 5, 8, 10, 16)
CP_CHOICES = (1, 2, 4, 8, 16)
#: The engines each recipe builds, with the logits of their main pass.
ROLES = {"sft": (("sft", "sft"),), "ppo": (("actor", "sft"), ("ref", "ref"), ("critic", "value")), "grpo": (("actor", "sft"), ("ref", "ref"))}


@dataclass
class MeshFit:
    mesh: Mesh
    peaks: dict[str, tuple[str, StageMemory]]  # role -> (pass, the stage with its highest peak)
    limit_gib: float
    capacity_gib: float
    rollout: RolloutFit | None
    cps: tuple[int, ...] = (1,)  # the CP sizes this (PP, EP) allows at the budget; self.mesh has the smallest
    states_only: bool = False
    levers: list[str] = field(default_factory=list)
    roles: dict = field(default_factory=dict)  # role -> RoleMemory (for the levers)

    @property
    def dp(self) -> int:
        """DP x CP."""
        return self.mesh.world // self.mesh.pp

    @property
    def worst_role(self) -> str:
        return max(self.peaks, key=lambda r: self.peaks[r][1].peak_gib)

    @property
    def peak_gib(self) -> float:
        return self.peaks[self.worst_role][1].peak_gib

    @property
    def states_gib(self) -> float:
        return max(s.static_gib for _, s in self.peaks.values())

    @property
    def fits(self) -> bool:
        if self.states_only:
            return self.states_gib <= self.limit_gib
        return self.peak_gib <= self.limit_gib

    def as_dict(self) -> dict:
        m = self.mesh
        out = {
            "gpus": m.world, "tp": 1, "pp": m.pp, "ep": m.ep, "cp": list(self.cps), "dp_x_cp": self.dp, "expert_dp": m.expert_dp,
            "fits": self.fits, "peak_gib": round(self.peak_gib, 2), "states_gib": round(self.states_gib, 2),
            "limit_gib": round(self.limit_gib, 2), "capacity_gib": self.capacity_gib,
            "roles": {
                role: {"pass": name, "stage": s.stage, "states_gib": round(s.static_gib, 2), "activations_gib": round(s.activations_gib, 2),
                       "transient_gib": round(s.transient_gib, 2), "logits_gib": round(s.logits_gib, 2),
                       "peak_gib": round(s.peak_gib, 2), "fits": s.peak_gib <= self.limit_gib}
                for role, (name, s) in self.peaks.items()
            },
        }
        if self.levers:
            out["levers"] = self.levers
        if self.rollout:
            out["rollout"] = self.rollout.as_dict()
        return out


@dataclass(frozen=True)
class RolloutFit:
    """The rollout an RL mesh gets: the smallest TP (one node and up) whose weights and the KV cache of one sequence of
    the longest length fit vLLM's share, bf16 before FP8 at equal TP, and how many such sequences one engine holds."""

    tp: int
    weights: str  # "bf16" | "fp8"
    weights_gib: float  # per GPU
    kv_gib_per_sequence: float  # per GPU (vLLM's TP replicates DS4's one-head cache)
    sequences: int  # full-length sequences one engine holds at once beside the weights
    length: int

    def as_dict(self) -> dict:
        return {"tp": self.tp, "weights": self.weights, "gib_per_gpu": round(self.weights_gib, 2),
                "kv_gib_per_sequence": round(self.kv_gib_per_sequence, 3), "sequences_at_once": self.sequences,
                "length": self.length}

    def cell(self) -> str:
        return f"TP{self.tp} {self.weights} {self.weights_gib:.1f}, {self.sequences} x {self.length // 1024}k"


def _rollout(sizes: DS4Sizes, gpus_per_node: int, world: int, share_gib: float, length: int) -> RolloutFit | None:
    """See :class:`RolloutFit`; ``None`` when no TP up to ``world`` holds the weights and one sequence."""
    kv = kv_cache_gib(sizes, length, 1)
    tp = gpus_per_node
    while tp <= world:
        for quant in (None, "fp8"):
            gib = rollout_weights_gib(sizes, tp, quant)
            if gib + kv <= share_gib:
                return RolloutFit(tp, quant or "bf16", gib, kv, int((share_gib - gib) // kv), length)
        tp *= 2
    return None


def _roles(sizes, mesh: Mesh, recipe: str, mtp: bool, optimizer, settings: dict) -> dict:
    out = {}
    for role, logits in ROLES[recipe]:
        trainable = role != "ref"
        rl = recipe != "sft"
        out[role] = role_memory(sizes, RoleInput(
            role=role, mesh=mesh, trainable=trainable, optimizer=(optimizer or OptimizerSettings()) if trainable else OptimizerSettings(),
            mtp=mtp and role != "critic", param_offload=rl, optimizer_offload=rl, logits=logits,
            tokens_per_gpu=settings["infer_tokens"] if role == "ref" else settings["tokens"],
            infer_tokens=settings["infer_tokens"] if (trainable and rl) else None,
            recompute=settings["recompute"], path=settings["path"], max_seq_len=settings["max_seq_len"],
            logits_kernel="unfused" if role == "critic" else settings["logits_kernel"],
        ))
    return out


def find_meshes(
    sizes: DS4Sizes,
    capacity_gib: float,
    gpu_counts: list[int],
    *,
    recipe: str = "sft",
    mtp: bool | None = None,
    optimizer: OptimizerSettings | None = None,
    headroom: float = DEFAULT_HEADROOM,
    tokens_per_gpu: int = 4096,
    infer_tokens_per_gpu: int | None = None,
    max_seq_len: int | None = None,
    path: str = "unfused",
    recompute: frozenset[str] | None = None,
    check_activations: bool = True,
    gpus_per_node: int = 8,
    rollout_share: float = 0.6,
    arch: str | None = None,
    levers_for: int = 6,
    logits_kernel: str = "unfused",
) -> list[MeshFit]:
    """Every valid mesh, ranked: fitting first, then fewest GPUs, then lowest peak (see the module doc).

    ``recompute``: the recomputed modules (``None``: full recompute, the default of ``plan --fit``).
    ``levers_for``: how many of the best non-fitting rows get their levers computed (each costs a search).
    ``logits_kernel``: what computes the logits step of the actor and reference (``fused``: verl's Triton kernel)."""
    check_headroom(headroom)
    mtp = (recipe == "sft") if mtp is None else mtp
    seq = max_seq_len or tokens_per_gpu
    settings = {"tokens": tokens_per_gpu, "infer_tokens": infer_tokens_per_gpu or 2 * tokens_per_gpu, "recompute": recompute,
                "path": path, "max_seq_len": seq, "logits_kernel": logits_kernel}
    limit = (1 - headroom) * capacity_gib
    out = []
    for world in sorted(set(gpu_counts)):
        for pp in PP_CHOICES:
            cps = tuple(cp for cp in CP_CHOICES if (world // pp) % cp == 0 and tokens_per_gpu * cp >= seq)
            if not cps:
                continue
            for ep in (d for d in range(1, sizes.n_routed_experts + 1) if sizes.n_routed_experts % d == 0):
                mesh = Mesh(world=world, pp=pp, ep=ep, cp=cps[0])
                if not mesh.valid_for(sizes):
                    continue
                roles = _roles(sizes, mesh, recipe, mtp, optimizer, settings)
                peaks = {role: rm.peak for role, rm in roles.items()}
                rollout = None if recipe == "sft" else _rollout(sizes, gpus_per_node, world, rollout_share * capacity_gib, seq)
                out.append(MeshFit(mesh, peaks, limit, capacity_gib, rollout, cps, not check_activations, roles=roles))
    out.sort(key=lambda f: (not f.fits, f.mesh.world, f.peak_gib, f.mesh.pp))
    for f in [f for f in out if not f.fits][:levers_for]:
        f.levers = fixes(f.roles[f.worst_role], sizes, limit, gpus_per_node, arch)
    return out
