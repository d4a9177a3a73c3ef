"""The memory model's inputs: typed values the recipe layer reads once from a composed config.

Nothing in :mod:`verl_ds4.memory` reads a config; :func:`verl_ds4.recipes.memory_inputs.read_memory_inputs`
reads the resolved recipe into a :class:`MemoryInputs` (and :func:`~verl_ds4.recipes.memory_inputs.kernel_settings`
one engine block into a :class:`KernelSettings`), and the model is a function of these. Each field names the
setting it comes from, so a setting is followed to its term in one step: config key -> field here -> the
term that reads the field (docs/memory.md, "From a setting to its term"). Findings come back as
:class:`Finding` (setting, message, fix), which the recipe layer turns into its ``Problem``.

Fields marked *as written* keep the config's raw value: the model's own rule converts or refuses it
(e.g. :func:`verl_ds4.memory.host.host_memory_gib`), so a bad value is reported where it always was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_ds4.memory.peak import DEFAULT_HEADROOM, path_of

__all__ = ["Finding", "KernelSettings", "MemoryInputs", "Mesh", "OptimizerSettings", "PassSetting", "RoleInput", "RolloutInput"]


@dataclass(frozen=True)
class Finding:
    """One finding of the model: the setting it is about, what is wrong, and how to fix it (the recipe
    layer's ``Problem`` is this class)."""

    setting: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.setting}: {self.message} Fix: {self.fix}"


@dataclass(frozen=True)
class Mesh:
    """One engine's parallel layout (TP = 1). ``world`` = GPUs of the job."""

    world: int
    pp: int = 1
    ep: int = 1
    cp: int = 1
    etp: int = 1
    tp: int = 1
    vpp: int | None = None  # virtual pipeline stages (interleaved 1F1B keeps more micro-batches in flight)
    vp_group: int | None = None  # Megatron's microbatch_group_size_per_vp_stage (None: PP, Megatron's default)

    @property
    def dense_dp(self) -> int:
        """Ranks that shard a dense parameter's optimizer state (DP x CP)."""
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def valid_for(self, sizes) -> bool:
        """Whether the sizes divide as Megatron needs (DP, expert-DP, EP over the experts, PP over the layers)."""
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
class PassSetting:
    """One pass's batching: ``tokens`` rows per GPU per micro-batch; ``micro_batch_size`` (None: dynamic) and its key."""

    tokens: int
    micro_batch_size: int | None = None
    key: str | None = None


@dataclass(frozen=True)
class KernelSettings:
    """One engine block's attention kernel path and recompute (``<engine_key>`` and its
    ``override_transformer_config``), as written; :mod:`verl_ds4.memory.kernels` checks them and the
    properties are what the peak model counts."""

    engine_key: str
    dsa_kernel_backend: str = "none"  # override_transformer_config.dsa_kernel_backend (null: none)
    sparse_attention: Any = None  # <engine>.sparse_attention, as written (None: verl's own engine config, no field)
    recompute_granularity: Any = None  # override_transformer_config.recompute_granularity, as written
    recompute_modules: tuple[str, ...] | None = None  # override_transformer_config.recompute_modules (None: unset)
    recompute_method: Any = None
    recompute_num_layers: Any = None
    indexer_loss_coeff: Any = None  # override_transformer_config.dsa_indexer_loss_coeff, as written
    indexer_sparse_loss: bool = False  # override_transformer_config.dsa_indexer_use_sparse_loss

    @property
    def path(self) -> str:
        """The attention path the peak model counts (:func:`verl_ds4.memory.peak.path_of`)."""
        return path_of(self.dsa_kernel_backend, self.sparse_attention)

    @property
    def recompute(self) -> frozenset[str] | None:
        """Recomputed modules (``None``: full recompute, only layer inputs kept)."""
        if self.recompute_granularity == "full":
            return None
        if self.recompute_granularity == "selective":
            return frozenset(self.recompute_modules or ())
        return frozenset()

    @property
    def dense_indexer_loss(self) -> bool:
        """Whether the engine trains Megatron's dense indexer loss (coefficient > 0, sparse loss off)."""
        return float(self.indexer_loss_coeff or 0.0) > 0 and not self.indexer_sparse_loss


@dataclass(frozen=True)
class RoleInput:
    """One engine's settings for the model (SFT engine, actor, reference or critic): its mesh, optimizer
    storage, offload, kernel path and recompute, and each pass's rows per GPU. :class:`verl_ds4.memory.roles.RoleMemory`
    extends it with the computed passes."""

    role: str
    mesh: Mesh
    trainable: bool
    tokens_per_gpu: int  # the main pass's rows per GPU per micro-batch
    param_offload: bool
    optimizer_offload: bool
    optimizer: OptimizerSettings
    mtp: bool = False
    recompute: frozenset[str] | None = frozenset({"moe_act", "mhc"})
    sequences: int | None = None  # sequences one update packs over all DP ranks (None: not bounded)
    path: str = "unfused"
    max_seq_len: int | None = None
    infer_tokens: int | None = None  # the forward pass's budget (None: no forward-only pass)
    logits: str = "sft"  # the main pass's logits step: sft, actor (the entropy term), ref or value
    logits_kernel: str = "unfused"  # what computes it: unfused (verl's non-fused path) or fused (verl's Triton kernel)
    dense_indexer_loss: bool = False
    # use_dynamic_bsz=false: the pass's micro_batch_size_per_gpu and its key (rows = size x longest / CP); else None
    micro_batch_size: tuple[str, int] | None = None
    infer_micro_batch_size: tuple[str, int] | None = None


@dataclass(frozen=True)
class RolloutInput:
    """The rollout engine (``actor_rollout_ref.rollout``): its name, TP, weight quantization and memory share, and
    what its KV cache holds (:mod:`verl_ds4.memory.rollout`): the lengths and the sequences sent at once."""

    name: Any
    tp: int
    quantization: str | None
    utilization: float
    prompt_length: int = 0  # actor_rollout_ref.rollout.prompt_length (data.max_prompt_length)
    response_length: int = 0  # actor_rollout_ref.rollout.response_length (data.max_response_length)
    max_num_seqs: int | None = None  # actor_rollout_ref.rollout.max_num_seqs: sequences one engine runs at once
    batch_sequences: int | None = None  # data.train_batch_size x actor_rollout_ref.rollout.n: sent to the engines together

    @property
    def length(self) -> int:
        """The longest sequence the cache holds (prompt + response)."""
        return self.prompt_length + self.response_length


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the memory check reads from a composed recipe, once.

    ``skipped`` says why the model does not run (``ds4.memory_check=off``, no model sizes, no GPU capacity,
    an invalid setting above); then only ``mode`` .. ``headroom`` are meaningful."""

    mode: str  # ds4.memory_check: error | warn | off
    gpus_per_node: int = 1
    capacity_gib: float | None = None  # ds4.mesh.gpu_memory_gib, else the table by ds4.mesh.hardware
    hardware: str | None = None  # ds4.mesh.hardware
    headroom: float = DEFAULT_HEADROOM  # ds4.memory_headroom
    skipped: str | None = None
    sizes: Any = None  # the model's sizes (verl_ds4.models.ds4.sizes.DS4Sizes or V4.1's)
    world: int = 0  # GPUs of the job (ds4.mesh.nnodes x gpus_per_node)
    roles: tuple[RoleInput, ...] = ()
    rollout: RolloutInput | None = None
    host_memory_gib: Any = None  # ds4.mesh.host_memory_gib, as written (None: the table by hardware)
    object_store_memory: Any = None  # ray_kwargs.ray_init.object_store_memory in bytes, as written (RL recipes)
    max_seq_len_knob: int | None = None  # ds4.max_seq_len (None: unset), named by the length lever
    fit_model: str = ""  # plan --fit --model for the recipe's model (named when no single change fits)
    fit_recipe: str = ""  # plan --fit --recipe
