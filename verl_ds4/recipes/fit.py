"""Which meshes fit: every TP=1 mesh (PP, EP, CP, DP) of a GPU count whose states fit with headroom.

    from verl_ds4.recipes.fit import find_meshes
    fits = find_meshes(sizes, capacity_gib=139.8, gpu_counts=[64], recipe="sft")

CP does not change a GPU's states (dense optimizer states shard over DP x CP = world / PP either
way), so one row stands for a (PP, EP) pair and lists the CP sizes it allows (those dividing
``world / PP``; each row's DP is ``world / (PP x CP)``). A mesh *fits* when the worst pipeline stage's weights + gradients + optimizer states
(:mod:`verl_ds4.recipes.memory`) leave ``headroom`` of the GPU free for activations, the CUDA
context and communication buffers: ``states <= (1 - headroom) x capacity``. With
``check_activations`` the activation estimate at ``tokens_per_gpu`` must fit too
(``states + activations <= capacity`` on every stage). For the RL recipes the rollout's weights are
reported at the smallest TP (from one node up) that fits vLLM's share, bf16 first, then FP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_ds4.models.ds4.sizes import DS4Sizes
from verl_ds4.recipes.memory import Mesh, OptimizerSettings, StageMemory, rollout_weights_gib, training_memory, worst_stage

__all__ = ["MeshFit", "find_meshes", "DEFAULT_HEADROOM", "PP_CHOICES", "CP_CHOICES"]

DEFAULT_HEADROOM = 0.15
PP_CHOICES = (1, 2, 4, 5, 8, 10, 16)
CP_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class MeshFit:
    mesh: Mesh
    worst: StageMemory
    peak_estimate_gib: float
    capacity_gib: float
    rollout: tuple[int, str, float] | None  # (TP, "bf16" | "fp8", GiB per GPU) or None
    cps: tuple[int, ...] = (1,)  # the CP sizes this (PP, EP) allows; self.mesh has CP 1

    @property
    def dp(self) -> int:
        """DP at CP 1 (DP x CP for any CP in ``cps``)."""
        return self.mesh.world // self.mesh.pp

    def as_dict(self) -> dict:
        m, w = self.mesh, self.worst
        out = {
            "gpus": m.world, "tp": 1, "pp": m.pp, "ep": m.ep, "cp": list(self.cps), "dp_x_cp": self.dp, "expert_dp": m.expert_dp,
            "worst_stage": w.stage, "weights_gib": round(w.weights_gib, 2), "grads_gib": round(w.grads_gib, 2),
            "optimizer_gib": round(w.optimizer_gib, 2), "states_gib": round(w.static_gib, 2),
            "peak_estimate_gib": round(self.peak_estimate_gib, 2), "capacity_gib": self.capacity_gib,
            "free_after_states_gib": round(self.capacity_gib - w.static_gib, 2),
        }
        if self.rollout:
            out["rollout"] = {"tp": self.rollout[0], "weights": self.rollout[1], "gib_per_gpu": round(self.rollout[2], 2)}
        return out


def _rollout(sizes: DS4Sizes, gpus_per_node: int, world: int, share_gib: float) -> tuple[int, str, float] | None:
    """The smallest rollout TP (one node and up) whose weights fit vLLM's share; bf16 before FP8 at equal TP."""
    tp = gpus_per_node
    while tp <= world:
        for quant in (None, "fp8"):
            gib = rollout_weights_gib(sizes, tp, quant)
            if gib <= share_gib:
                return tp, quant or "bf16", gib
        tp *= 2
    return None


def find_meshes(
    sizes: DS4Sizes,
    capacity_gib: float,
    gpu_counts: list[int],
    *,
    recipe: str = "sft",
    mtp: bool | None = None,
    optimizer: OptimizerSettings | None = None,
    headroom: float = DEFAULT_HEADROOM,
    tokens_per_gpu: int = 8192,
    check_activations: bool = False,
    gpus_per_node: int = 8,
    rollout_share: float = 0.6,
) -> list[MeshFit]:
    """Meshes that fit, fewest GPUs first, then the most memory left after the states."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom is {headroom}; expected a fraction in [0, 1).")
    mtp = (recipe == "sft") if mtp is None else mtp
    out = []
    for world in sorted(set(gpu_counts)):
        for pp in PP_CHOICES:
            for ep in (d for d in range(1, sizes.n_routed_experts + 1) if sizes.n_routed_experts % d == 0):
                mesh = Mesh(world=world, pp=pp, ep=ep, cp=1)
                if not mesh.valid_for(sizes):
                    continue
                stages = training_memory(sizes, mesh, optimizer, mtp=mtp, tokens_per_gpu=tokens_per_gpu)
                worst = worst_stage(stages)
                peak = max(s.total_gib for s in stages)
                if worst.static_gib > (1 - headroom) * capacity_gib or (check_activations and peak > capacity_gib):
                    continue
                rollout = None if recipe == "sft" else _rollout(sizes, gpus_per_node, world, rollout_share * capacity_gib)
                cps = tuple(cp for cp in CP_CHOICES if (world // pp) % cp == 0)
                out.append(MeshFit(mesh, worst, peak, capacity_gib, rollout, cps))
    out.sort(key=lambda f: (f.mesh.world, f.worst.static_gib, f.mesh.pp))
    return out
