"""DS4's GPU memory per role and per GPU, in closed form from the model's config (pure Python).

    from verl_ds4.recipes.memory import Mesh, OptimizerSettings, training_memory
    stages = training_memory(sizes, Mesh(world=64, pp=4, ep=8), OptimizerSettings(), mtp=True, tokens_per_gpu=8192)
    worst = max(stages, key=lambda s: s.static_gib)       # the stage that decides whether a mesh fits

Parameter counts come from :class:`verl_ds4.models.ds4.sizes.DS4Sizes` (checked against the
meta-device builds). What each GPU of a pipeline stage holds, TP = 1 (DS4 has no TP):

* **weights**: bf16, 2 bytes per local parameter. Local = the stage's dense parameters (replicated
  over DP x CP and EP) + its routed experts / EP. Stage 0 holds the input embedding, the last stage
  the output head (+ final norm + HC head; a value head instead for a critic) and the MTP layers.
  Layers split as Megatron-Bridge's even layout (earlier stages take the remainder).
* **gradients**: Megatron DDP's main-grad buffer, one per local parameter, fp32 (verl sets
  ``grad_reduce_in_fp32`` unless the precision-aware optimizer has bf16 main grads). Not sharded.
* **optimizer**: Adam's master copy + two moments, fp32 (12 bytes), sharded by the distributed
  optimizer over the data-parallel group of each parameter: dense over DP x CP
  (``world / (TP x PP)``), routed experts over expert-DP (``world / (ETP x EP x PP)``). The
  precision-aware optimizer stores the moments in its ``exp_avg*_dtype`` and, with
  ``store_param_remainders`` (default), the fp32 master as a 16-bit remainder of the bf16 weight
  (2 bytes). Megatron's CPU optimizer offload moves ``optimizer_offload_fraction`` of the optimizer
  state (and an fp32 copy of its gradients) to host memory.
* **activations** (an *estimate*): bytes one token leaves for the backward pass in one layer,
  ``2 x A(ratio)`` (bf16 elements ``A`` listed by :func:`activation_elements`, assuming selective
  recompute of ``moe_act`` and ``mhc`` as the recipes set, flash-style attention that keeps no
  score matrix, THD packing), times the stage's layers, times the GPU's rows per micro-batch (the
  per-GPU token budget; CP splits the packed buffer, so a GPU holds its budget), times the
  micro-batches in flight on the stage under non-interleaved 1F1B (``PP - stage``, or fewer when one
  update has fewer micro-batches: :mod:`.memory_check` bounds them from the batch sizes, the
  longest sequence and the budget); plus the last
  stage's logits (bf16 + fp32 for the loss, one micro-batch). CUDA context, NCCL buffers and
  allocator fragmentation are not included: keep headroom for them.

verl's ``param_offload`` / ``optimizer_offload`` move a role's states to the host *between* phases
and back for its update: they do not lower a role's own peak, only what sits beside another role
(see :mod:`verl_ds4.recipes.memory_check`).
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_ds4 import ds41_facts
from verl_ds4.models.ds4.provider import pipeline_stage_layers
from verl_ds4.models.ds4.sizes import ROUTED, DS4Sizes
from verl_ds4.models.ds41.sizes import DS41Sizes

__all__ = [
    "GIB", "GPU_MEMORY_GIB", "OPTIM_KEYS", "Mesh", "OptimizerSettings", "StageMemory", "activation_elements",
    "layer_activation_elements",
    "gpu_memory_gib", "rollout_weights_gib", "training_memory", "worst_stage",
]

GIB = float(1 << 30)

#: Where each trainable role's optimizer settings live in a composed recipe.
OPTIM_KEYS = {"sft": "optim", "actor": "actor_rollout_ref.actor.optim", "critic": "critic.optim"}

#: Usable memory per GPU (GiB) as the driver reports it (``torch.cuda.mem_get_info`` total), by the
#: mesh's ``hardware`` name. Approximate: set ``ds4.mesh.gpu_memory_gib`` for your exact parts.
GPU_MEMORY_GIB = {
    "H100-80GB": 79.2,
    "H200": 139.8,
    "B200": 178.4,
    "GB200": 184.0,
    "GB300": 279.0,
}


def gpu_memory_gib(hardware: str | None, explicit: float | None = None) -> float:
    """Capacity of one GPU: ``explicit`` (``ds4.mesh.gpu_memory_gib``) wins, else the table by name.

    Raises:
        ValueError: unknown ``hardware`` and no ``explicit`` capacity.
    """
    if explicit is not None:
        value = float(explicit)
        if value <= 0:
            raise ValueError(f"ds4.mesh.gpu_memory_gib is {explicit!r}; expected a positive number of GiB.")
        return value
    if hardware in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[hardware]
    raise ValueError(
        f"ds4.mesh.hardware is {hardware!r}, which the memory model does not know; known: {sorted(GPU_MEMORY_GIB)}. "
        "Use one of them or set ds4.mesh.gpu_memory_gib=<GiB per GPU>."
    )


@dataclass(frozen=True)
class Mesh:
    """One engine's parallel layout (TP = 1). ``world`` = GPUs of the job."""

    world: int
    pp: int = 1
    ep: int = 1
    cp: int = 1
    etp: int = 1
    tp: int = 1

    @property
    def dense_dp(self) -> int:
        """Ranks that shard a dense parameter's optimizer state (DP x CP)."""
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def valid_for(self, sizes: DS4Sizes) -> bool:
        return (
            self.world % (self.tp * self.pp * self.cp) == 0
            and self.world % (self.etp * self.ep * self.pp) == 0
            and sizes.n_routed_experts % self.ep == 0
            and self.pp <= sizes.num_layers
        )


@dataclass(frozen=True)
class OptimizerSettings:
    """How Megatron stores gradients and Adam's state (bytes per parameter)."""

    distributed: bool = True
    main_grads_bytes: int = 4
    main_params_bytes: int = 4
    exp_avg_bytes: int = 4
    exp_avg_sq_bytes: int = 4
    cpu_offload_fraction: float = 0.0

    @property
    def state_bytes(self) -> int:
        return self.main_params_bytes + self.exp_avg_bytes + self.exp_avg_sq_bytes


@dataclass(frozen=True)
class StageMemory:
    """What one GPU of pipeline stage ``stage`` holds (GiB), and host memory it offloads to."""

    stage: int
    layers: int
    params: int  # local parameters of this GPU
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    host_gib: float  # Megatron's CPU optimizer offload, per GPU

    @property
    def static_gib(self) -> float:
        """Weights + gradients + optimizer states: what must fit before a single activation."""
        return self.weights_gib + self.grads_gib + self.optimizer_gib

    @property
    def total_gib(self) -> float:
        return self.static_gib + self.activations_gib


def activation_elements(sizes: DS4Sizes, ratio: int, recompute: frozenset[str] = frozenset({"moe_act", "mhc"})) -> int:
    """bf16 elements one token keeps for backward in one layer of ``ratio`` (an estimate).

    mHC: each of the two sites keeps its ``n x h`` input streams (and, without ``mhc`` recompute,
    its mixed ``n x h`` output). Attention: the normed input ``h``, the q down-projection and its
    norm ``2 r_q``, queries and the attention output ``2 n_h d``, the KV head ``d``, the grouped
    output's low rank ``g r_o``; the compressor's KV and gate rows ``2c`` (``c = 2d`` CSA, ``d``
    HCA); the indexer's queries, head weights and KV/gate rows. MoE: the normed input ``h``, router
    logits (fp32: ``2E``), the ``k`` dispatched copies ``k h``, their gate/up output ``2 k I`` (and
    the activation ``k I`` without ``moe_act`` recompute), the expert outputs ``k h``; the shared
    expert's ``3 I`` and the combined output ``h``.
    """
    h, n, d = sizes.hidden_size, sizes.hc_mult, sizes.head_dim
    k, inter = sizes.num_experts_per_tok, sizes.moe_intermediate_size
    mhc = 2 * n * h * (1 if "mhc" in recompute else 2)
    attention = h + 2 * sizes.q_lora_rank + 2 * sizes.num_attention_heads * d + d + sizes.o_groups * sizes.o_lora_rank
    if ratio:
        attention += 2 * (2 * d if ratio == 4 else d)
    if ratio == 4:
        ni, di = sizes.index_n_heads, sizes.index_head_dim
        attention += ni * di + ni + 2 * 2 * di
    moe = h + 2 * sizes.n_routed_experts + k * h + 2 * k * inter + (0 if "moe_act" in recompute else k * inter) + k * h
    moe += sizes.n_shared_experts * 3 * inter + h
    return mhc + attention + moe


def layer_activation_elements(sizes: DS4Sizes, layer: int, recompute: frozenset[str] = frozenset({"moe_act", "mhc"})) -> int:
    """:func:`activation_elements` of decoder layer ``layer`` (V4: by its ratio; V4.1: by its role)."""
    if isinstance(sizes, DS41Sizes):
        return _v41_activation_elements(sizes, layer, recompute)
    return activation_elements(sizes, sizes.compress_ratios[layer], recompute)


def _v41_activation_elements(sizes: DS41Sizes, layer: int, recompute: frozenset[str]) -> int:
    """V4.1's per-token estimate: V4's window-only layer (mHC, attention, MoE), plus a Full layer's
    compressor rows (KV ``d``, and the gate ``d`` at ratio > 1), an index source's indexer queries
    and head weights (``n_I d_I + n_I``, a Full layer's key ``d_I`` too), and an Engram layer's
    gathered table rows ``(N-1) heads hd`` with its projected key / value ``2 (N-1) heads hd``."""
    elements = activation_elements(sizes, 0, recompute)
    role, ratio = sizes.roles[layer], sizes.compress_ratios[layer]
    if role == ds41_facts.FULL:
        elements += sizes.head_dim * (2 if ratio > 1 else 1) + sizes.index_head_dim
    if role in (ds41_facts.FULL, ds41_facts.REINDEX):
        elements += sizes.index_n_heads * (sizes.index_head_dim + 1)
    if layer in sizes.engram_layers:
        elements += 3 * (sizes.engram_max_ngram_size - 1) * sizes.engram_n_heads * sizes.engram_head_dim
    return elements


def _stage_params(sizes: DS4Sizes, pp: int, stage: int, mtp: bool, value_head: bool, recompute: frozenset[str]) -> tuple[int, int, list[int]]:
    """(dense parameters, expert-sharded parameters, per-layer activation elements) of one pipeline stage.

    Expert-sharded: the components :attr:`DS4Sizes.expert_sharded` names (V4: routed experts; V4.1:
    routed experts and the Engram tables), split over EP, their optimizer state over expert-DP."""
    counts = pipeline_stage_layers(sizes.num_layers, pp)
    start = sum(counts[:stage])
    layers = range(start, start + counts[stage])
    dense = routed = 0
    acts = []
    for i in layers:
        parts = sizes.layer_params(i)
        routed += sum(parts[k] for k in sizes.expert_sharded)
        dense += sum(v for key, v in parts.items() if key not in sizes.expert_sharded)
        acts.append(layer_activation_elements(sizes, i, recompute))
    if stage == 0:
        dense += sizes.embedding()
    if stage == pp - 1:
        dense += sizes.head() - (sizes.vocab_size - 1) * sizes.hidden_size * value_head  # value head: h x 1
        if mtp:
            for _ in range(sizes.mtp_layers):
                parts = sizes.mtp_layer()
                routed += parts[ROUTED]
                dense += sum(v for key, v in parts.items() if key != ROUTED)
                acts.append(activation_elements(sizes, 0, recompute))
    return dense, routed, acts


def training_memory(
    sizes: DS4Sizes,
    mesh: Mesh,
    optimizer: OptimizerSettings | None = None,
    *,
    trainable: bool = True,
    mtp: bool = False,
    value_head: bool = False,
    tokens_per_gpu: int = 0,
    recompute: frozenset[str] = frozenset({"moe_act", "mhc"}),
    micro_batches: int | None = None,
) -> list[StageMemory]:
    """Per-GPU memory of every pipeline stage of one engine (actor, critic, SFT; ``trainable=False``:
    a reference model, weights only, forward-only activations of one layer). ``micro_batches``: an
    upper bound on the micro-batches of one update (fewer than ``PP`` caps the ones in flight)."""
    optimizer = optimizer or OptimizerSettings()
    out = []
    for stage in range(mesh.pp):
        dense, routed, layer_acts = _stage_params(sizes, mesh.pp, stage, mtp, value_head, recompute)
        local = dense + routed // mesh.ep
        weights = 2 * local
        grads = optim = host = 0.0
        if trainable:
            grads = optimizer.main_grads_bytes * local
            shard_dense = dense / mesh.dense_dp if optimizer.distributed else dense
            shard_routed = routed / mesh.ep / mesh.expert_dp if optimizer.distributed else routed / mesh.ep
            state = optimizer.state_bytes * (shard_dense + shard_routed)
            f = optimizer.cpu_offload_fraction
            optim, host = state * (1 - f), f * (state + 4 * (shard_dense + shard_routed))
        per_token = 2 * sum(layer_acts)
        if trainable:
            in_flight = mesh.pp - stage if micro_batches is None else max(1, min(mesh.pp - stage, micro_batches))
            acts = per_token * tokens_per_gpu * in_flight
            if stage == mesh.pp - 1 and not value_head:
                acts += 6 * tokens_per_gpu * sizes.vocab_size  # logits: bf16 + fp32 for the loss
        else:
            acts = per_token / max(len(layer_acts), 1) * tokens_per_gpu  # forward only: about one layer live
        out.append(
            StageMemory(stage, len(layer_acts), local, weights / GIB, grads / GIB, optim / GIB, acts / GIB, host / GIB)
        )
    return out


def worst_stage(stages: list[StageMemory]) -> StageMemory:
    """The stage with the most weights + gradients + optimizer states (ties: the earlier stage)."""
    return max(stages, key=lambda s: (s.static_gib, -s.stage))


def rollout_weights_gib(sizes: DS4Sizes, tp: int, quantization: str | None = None) -> float:
    """Rollout (vLLM / SGLang) weights per GPU: every parameter but MTP, bf16 (fp8: 1 byte), split over TP."""
    bytes_per = 1 if quantization == "fp8" else 2
    return bytes_per * sizes.total() / tp / GIB
