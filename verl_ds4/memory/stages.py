"""DS4's GPU memory per role and per GPU, in closed form from the model's config (pure Python).

    from verl_ds4.memory.stages import Mesh, OptimizerSettings, training_memory
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
* **what a step adds** (:mod:`verl_ds4.memory.peak`): the activations every micro-batch in flight
  keeps for backward (``PP - stage`` under non-interleaved 1F1B, more chunks under interleaved 1F1B, or
  fewer when one update has fewer micro-batches: :mod:`.micro_batches` counts them the way verl packs the
  batch), for the recipe's attention kernel path and recompute, at the GPU's rows per micro-batch
  (the per-GPU token budget; CP splits the packed buffer, so a GPU holds its budget); the largest
  transient (one layer's backward, or the loss buffers of the logits on the last stage, MTP's too);
  the expert-parallel all-to-all buffers; an allocator margin. The *peak* is states + these.

verl's ``param_offload`` / ``optimizer_offload`` move a role's states to the host *between* phases
and back for its update: they do not lower a role's own peak, only what sits beside another role
(see :mod:`verl_ds4.memory.roles`).
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_ds4 import ds4_facts
from verl_ds4.models.ds4.provider import pipeline_stage_layers
from verl_ds4.models.ds4.sizes import ROUTED, DS4Sizes
from verl_ds4.memory.micro_batches import in_flight as _in_flight
from verl_ds4.memory.peak import StepShape, step_peak
from verl_ds4.memory.types import Mesh, OptimizerSettings

__all__ = [
    "GIB", "GPU_MEMORY_GIB", "Mesh", "OptimizerSettings", "StageMemory", "gpu_memory_gib",
    "peak_stage", "rollout_weights_gib", "training_memory", "worst_stage",
]

GIB = float(1 << 30)

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
class StageMemory:
    """What one GPU of pipeline stage ``stage`` holds at its peak (GiB), and host memory it offloads to.

    The dynamic terms (:mod:`verl_ds4.memory.peak`): ``activations_gib`` kept for backward by every
    micro-batch in flight, ``transient_gib`` the largest one-off allocation (a layer's backward, or the
    logits' loss buffers, ``logits_gib`` of which), ``a2a_gib`` the expert-parallel all-to-all buffers,
    ``margin_gib`` the allocator margin."""

    stage: int
    layers: int
    params: int  # local parameters of this GPU
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    host_gib: float  # Megatron's CPU optimizer offload, per GPU
    transient_gib: float = 0.0
    logits_gib: float = 0.0
    a2a_gib: float = 0.0
    margin_gib: float = 0.0
    peak_detail: str = ""

    @property
    def static_gib(self) -> float:
        """Weights + gradients + optimizer states: what must fit before a single activation."""
        return self.weights_gib + self.grads_gib + self.optimizer_gib

    @property
    def dynamic_gib(self) -> float:
        """What a step adds on top of the states at its peak."""
        return self.activations_gib + self.transient_gib + self.a2a_gib + self.margin_gib

    @property
    def peak_gib(self) -> float:
        return self.static_gib + self.dynamic_gib

    total_gib = peak_gib


def _stage_params(sizes: DS4Sizes, pp: int, stage: int, mtp: bool, value_head: bool) -> tuple[int, int, list[int], int]:
    """(dense parameters, expert-sharded parameters, decoder layer indices, MTP depths) of one pipeline stage.

    Expert-sharded: the components :attr:`DS4Sizes.expert_sharded` names (V4: routed experts; V4.1:
    routed experts and the Engram tables), split over EP, their optimizer state over expert-DP."""
    counts = pipeline_stage_layers(sizes.num_layers, pp)
    start = sum(counts[:stage])
    layers = list(range(start, start + counts[stage]))
    dense = routed = 0
    for i in layers:
        parts = sizes.layer_params(i)
        routed += sum(parts[k] for k in sizes.expert_sharded)
        dense += sum(v for key, v in parts.items() if key not in sizes.expert_sharded)
    if stage == 0:
        dense += sizes.embedding()
    mtp_depths = 0
    if stage == pp - 1:
        dense += sizes.head() - (sizes.vocab_size - 1) * sizes.hidden_size * value_head  # value head: h x 1
        if mtp:
            mtp_depths = sizes.mtp_layers
            for _ in range(sizes.mtp_layers):
                parts = sizes.mtp_layer()
                routed += parts[ROUTED]
                dense += sum(v for key, v in parts.items() if key != ROUTED)
    return dense, routed, layers, mtp_depths


def training_memory(
    sizes: DS4Sizes,
    mesh: Mesh,
    optimizer: OptimizerSettings | None = None,
    *,
    trainable: bool = True,
    mtp: bool = False,
    value_head: bool = False,
    tokens_per_gpu: int = 0,
    recompute: frozenset[str] | None = frozenset({"moe_act", "mhc"}),
    micro_batches: int | None = None,
    path: str = "unfused",
    training: bool | None = None,
    logits_pass: str | None = None,
    logits_kernel: str = "unfused",
    max_seq_len: int | None = None,
    dense_indexer_loss: bool = False,
    margin: bool = True,
) -> list[StageMemory]:
    """Per-GPU memory of every pipeline stage of one engine at its peak.

    ``trainable``: the engine has gradients and an optimizer (SFT, actor, critic; ``False``: a
    reference model, weights only). ``training``: the pass is a training step (default: ``trainable``);
    ``False`` for a forward-only pass (log-probs, values) of a trainable engine. ``recompute``: the
    recomputed modules (``None``: full recompute). ``path``: the attention kernel path
    (:data:`verl_ds4.memory.peak.ATTENTION_PATHS`). ``micro_batches``: an upper bound on the
    micro-batches of one update (fewer than ``PP`` caps the ones in flight). ``logits_pass``: the pass whose
    loss buffers the last stage holds (default ``sft`` for training, ``logprob`` for a forward), ``logits_kernel``
    what computes them (``unfused`` or ``fused``: :func:`verl_ds4.memory.terms.logits_step_bytes`). ``max_seq_len``: the longest sequence (default: the budget x CP)."""
    optimizer = optimizer or OptimizerSettings()
    training = trainable if training is None else training
    out = []
    for stage in range(mesh.pp):
        dense, routed, layers, mtp_depths = _stage_params(sizes, mesh.pp, stage, mtp, value_head)
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
        last = stage == mesh.pp - 1
        logits = None
        if last:
            logits = "value" if value_head else (logits_pass or ("sft" if training else "logprob"))
        in_flight = _in_flight(mesh.pp, stage, micro_batches, mesh.vpp, mesh.vp_group)
        step = step_peak(
            sizes, [sizes.compress_ratios[i] for i in layers] + [ds4_facts.MTP_COMPRESS_RATIO] * mtp_depths, path=path,
            shape=StepShape(max(tokens_per_gpu, 1), mesh.cp, max_seq_len), in_flight=in_flight, training=training,
            recompute=recompute, logits=logits, logits_kernel=logits_kernel, mtp_depths=mtp_depths, ep=mesh.ep, tp=mesh.tp, margin=margin,
            layer_ids=layers + [None] * mtp_depths, dense_indexer_loss=dense_indexer_loss,
        )
        out.append(StageMemory(
            stage, len(layers) + mtp_depths, local, weights / GIB, grads / GIB, optim / GIB, step.activations_gib,
            host / GIB, step.transient_gib, step.logits_gib, step.a2a_gib, step.margin_gib, step.detail,
        ))
    return out


def worst_stage(stages: list[StageMemory]) -> StageMemory:
    """The stage with the most weights + gradients + optimizer states (ties: the earlier stage)."""
    return max(stages, key=lambda s: (s.static_gib, -s.stage))


def peak_stage(stages: list[StageMemory]) -> StageMemory:
    """The stage with the highest peak (states + what the step adds; ties: the earlier stage)."""
    return max(stages, key=lambda s: (s.peak_gib, -s.stage))


def rollout_weights_gib(sizes: DS4Sizes, tp: int, quantization: str | None = None) -> float:
    """Rollout (vLLM / SGLang) weights per GPU: every parameter but MTP, bf16 (fp8: 1 byte), split over TP."""
    bytes_per = 1 if quantization == "fp8" else 2
    return bytes_per * sizes.total() / tp / GIB
