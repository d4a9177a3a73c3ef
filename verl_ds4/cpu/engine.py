"""CPU support for verl's Megatron engine (``VERL_PLATFORM=cpu``).

verl 0.9.1's Megatron engine assumes CUDA in a handful of places it reaches through
Megatron-Core and mbridge (docs/ds4-context-parallel.md section 8 lists them). The CPU
engines here are verl-ds4's DS4 engines (:mod:`verl_ds4.engine.megatron`) with a CPU mixin
slotted between them and verl's engine, replacing exactly those steps. They are registered
for ``device="cpu"`` only (:func:`register_cpu_engines`; importing this module under
``VERL_PLATFORM=cpu`` registers them, e.g. ``VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,
verl_ds4.cpu.engine``), so a GPU run never constructs them.

Models are built by a CPU model builder chosen by the HF ``model_type``
(:func:`register_cpu_model_builder`). The builders live with their models and register on
import; select one with verl's per-model import knob ``model.external_lib``:
``verl_ds4.cpu.ds4_builder`` (``deepseek_v4``: the full DS4, or the attention-only proxy) or
``verl_ds4.cpu.tiny_dense`` (``llama``: the tiny dense stepping stone).

Precision: verl's ``McoreEngineConfig`` admits only bf16/fp16 parameters; select
:class:`CPUMcoreEngineConfig` (``engine._target_=verl_ds4.cpu.engine.CPUMcoreEngineConfig
engine.dtype=float32``) for fp32 parameters and compute, which the CPU demo and tests use.

What each override does, and why:

* ``_build_tf_config``: no bridge. mbridge forces the TransformerEngine layer spec and
  Megatron-Bridge needs Python 3.12; the ``TransformerConfig`` comes from a *CPU model
  builder* chosen by the HF ``model_type`` (:data:`CPU_MODEL_BUILDERS`), with the settings a
  CPU needs (``use_cpu_initialization``, no fused kernels). A user override that contradicts
  one of them is an error, not silently replaced.
* ``_build_megatron_module``: builds the ``GPTModel`` from a local layer spec (pure-PyTorch
  attention) and wraps it in Megatron's ``DistributedDataParallel`` inside
  :func:`cuda_literals_on_cpu` (Megatron's grad buffers are allocated on
  ``torch.cuda.current_device()``). Initial weights: ``engine.dist_checkpointing_path`` when
  given (loaded after the build), else the builder's: the DS4 builder loads the model folder's
  safetensors when there are any, other builders (and folders without weights) a seeded init.
* ``_build_optimizer`` / ``optimizer_step`` / ``forward_backward_batch`` /
  ``save_checkpoint`` / ``load_checkpoint``: the same verl methods, run inside
  :func:`cuda_literals_on_cpu`, because Megatron-Core creates ``device="cuda"`` scalars in
  the optimizer (found-inf, grad-norm, clip buffers), the schedule (``total_num_tokens``)
  and calls ``torch.cuda.synchronize`` in dist-checkpointing.
* RNG: Megatron's model-parallel RNG tracker holds CUDA generator states; on CPU it is
  replaced by :class:`CPURNGStatesTracker` (same interface, CPU generator), seeded like
  Megatron seeds its tracker, so checkpoints carry and restore RNG state.
* Progress: after every ``train_batch`` the logging rank prints
  ``[verl-ds4] step N | loss L | T tok/s | elapsed S`` (loss averaged over data parallel ranks
  as verl's own console line has it; tokens are the global batch's).
* Resume: torch's Adam creates its ``step`` state lazily; Megatron's distributed optimizer
  reads it while building the state dict to load into. :meth:`load_checkpoint` creates the
  empty optimizer state first (zeros, no parameter update), and loads under ``no_grad``
  (the distributed optimizer copies into its fp32 main parameters in place); afterwards
  each parameter gets its own Adam ``step`` tensor set from the loaded param groups
  (Megatron's non-TE/Apex load path shares one tensor between all parameters and
  overwrites it with the pre-load placeholder).

Where each piece lives: :mod:`.engine_config` (fp32 config), :mod:`verl_ds4.substitutes.cuda_literals`
(:func:`cuda_literals_on_cpu`), :mod:`.rng` (the CPU RNG tracker), :mod:`.builders` (the model
builder registry and CPU settings), :mod:`.optimizer_state` (the Adam step-state repair),
:mod:`.progress` (the progress line); this module holds the engine mixin, the two engines and
their registration.

Not supported on CPU (raises): LoRA/PEFT, HF-format model save/load (needs a bridge), fused
kernels, Megatron FSDP, pipeline/virtual-pipeline parallelism, ``param_offload``.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

from verl_ds4.cpu.builders import CPU_MODEL_BUILDERS, CPUModelBuilder, cpu_transformer_overrides, register_cpu_model_builder
from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu
from verl_ds4.cpu.engine_config import CPUMcoreEngineConfig
from verl_ds4.cpu.optimizer_state import create_empty_optimizer_state, restore_adam_step_counters
from verl_ds4.cpu.progress import global_step_of, progress_line
from verl_ds4.cpu.rng import CPURNGStatesTracker, install_cpu_rng_tracker
from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead, DS4MegatronEngineWithValueHead

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_MODEL_BUILDERS",
    "CPUMcoreEngineConfig",
    "CPUMegatronEngineWithLMHead",
    "CPUMegatronEngineWithValueHead",
    "CPUModelBuilder",
    "CPURNGStatesTracker",
    "cuda_literals_on_cpu",
    "register_cpu_engines",
    "register_cpu_model_builder",
]


class _ValueHead(torch.nn.Linear):
    """Scalar value head replacing the LM output layer: returns ``(values_fp32, None)``."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1, bias=False)

    def forward(self, hidden, weight=None, runtime_gather_output=None):  # Megatron output-layer signature
        return super().forward(hidden).float(), None


# ---------------------------------------------------------------------------------------
# The CPU engine
# ---------------------------------------------------------------------------------------


class _CPUMegatronEngineMixin:
    """CPU overrides shared by the LM-head and value-head engines (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._validate_cpu_engine_config()
        install_cpu_rng_tracker(self.engine_config.seed)

    # -- configuration ------------------------------------------------------------------

    #: How the refusals name this engine.
    ENGINE_NAME = "CPU Megatron engine"

    def _validate_cpu_engine_config(self) -> None:
        problems = self._unsupported_settings()
        if problems:
            raise ValueError(f"The {self.ENGINE_NAME} does not support: " + "; ".join(problems) + ".")

    def _unsupported_settings(self) -> list[str]:
        """What a CPU engine cannot run, each with its fix; then :meth:`_checkpoint_setting_problems`."""
        ec = self.engine_config
        problems = []
        if ec.pipeline_model_parallel_size != 1 or (ec.virtual_pipeline_model_parallel_size or 1) != 1:
            problems.append("pipeline parallelism (set pipeline_model_parallel_size=1)")
        if ec.use_megatron_fsdp:
            problems.append("Megatron FSDP (set use_megatron_fsdp=False)")
        if ec.param_offload:
            problems.append("parameter offload (set param_offload=False)")
        if getattr(self.model_config, "lora_rank", 0) or self.model_config.get("lora_adapter_path", None):
            problems.append("LoRA/PEFT")
        return problems + self._checkpoint_setting_problems()

    def _checkpoint_setting_problems(self) -> list[str]:
        """This engine's model builders load no HF format through a bridge: training needs dist checkpointing."""
        ec = self.engine_config
        if not ec.forward_only and not ec.use_dist_checkpointing:
            return ["HF-format checkpoints (they need a Megatron bridge): set engine.use_dist_checkpointing=True "
                    "(with dist_checkpointing_path unset, the model starts from the builder's weights: the folder's "
                    "safetensors for the DS4 builder, else a seeded init)"]
        return []

    def _build_tf_config(self):
        from verl.utils.megatron_utils import check_mtp_config, mapping_string_to_attn_backend
        from verl.utils.torch_dtypes import PrecisionType

        self.is_value_model = self.model_config.model_type == "value_model"
        self.share_embeddings_and_output_weights = self.model_config.share_embeddings_and_output_weights
        if self.is_value_model:
            self.model_config.hf_config.tie_word_embeddings = False
            self.share_embeddings_and_output_weights = False
        check_mtp_config(self.model_config, self.engine_config)

        self.param_dtype = PrecisionType.to_dtype(self.engine_config.dtype)
        self.dtype = PrecisionType.to_dtype(self.param_dtype)

        model_type = getattr(self.model_config.hf_config, "model_type", None)
        builder = CPU_MODEL_BUILDERS.get(model_type)
        if builder is None:
            raise ValueError(
                f"No CPU model builder for HF model_type={model_type!r}; registered: {sorted(CPU_MODEL_BUILDERS)}. "
                "Set model.external_lib to the module that registers it: verl_ds4.cpu.ds4_builder (the tiny "
                "DS4 or the DS4 proxy, deepseek_v4), verl_ds4.cpu.ds41_builder (DeepSeek-V4.1, deepseek_v41) or verl_ds4.cpu.tiny_dense (the tiny dense model, llama); or call "
                "verl_ds4.cpu.engine.register_cpu_model_builder()."
            )
        self._cpu_model_builder = builder
        overrides = cpu_transformer_overrides(
            mapping_string_to_attn_backend(dict(self.engine_config.override_transformer_config or {}))
        )
        tf_config = builder.transformer_config(self.model_config.hf_config, self.param_dtype, overrides)
        if getattr(self, "enable_routing_replay", False):
            # verl's own _build_tf_config does this (replaced here): routers built from this config
            # get a RouterReplay (verl's engine __init__ already applied its router replay patch).
            if hasattr(tf_config, "moe_enable_routing_replay"):
                tf_config.moe_enable_routing_replay = True
            else:
                tf_config.enable_routing_replay = True
        if torch.distributed.get_rank() == 0:
            print(f"TF config: {tf_config}")
        self.tf_config = tf_config
        self.provider = None
        self.bridge = None
        self.vanilla_bridge = True
        self.weight_converter = None
        self.peft_cls = None

    # -- model --------------------------------------------------------------------------

    def _build_megatron_module(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from verl.utils.model import load_mcore_dist_weights, print_model_size

        hf_config = self.model_config.hf_config
        builder = self._cpu_model_builder
        head = {"value_head": self.is_value_model} if builder.builds_value_head else {}
        model = builder.build(
            self.tf_config,
            hf_config,
            pre_process=True,
            post_process=True,
            share_embeddings=self.share_embeddings_and_output_weights,
            **head,
        )
        if self.is_value_model and not builder.builds_value_head:
            model.output_layer = _ValueHead(self.tf_config.hidden_size).to(self.param_dtype)
        for key, value in (self.engine_config.override_mcore_model_config or {}).items():
            raise ValueError(
                f"engine.override_mcore_model_config.{key}={value!r} is not supported by the CPU model builder."
            )

        if not self.engine_config.forward_only:
            ddp_settings = {
                "use_distributed_optimizer": self.engine_config.use_distributed_optimizer,
                **self._resolve_override_ddp_config(),
            }
            for key in ("overlap_grad_reduce", "overlap_param_gather"):
                if ddp_settings.get(key):
                    raise ValueError(f"engine.override_ddp_config.{key}=True needs CUDA streams; unset it on CPU.")
            with cuda_literals_on_cpu():
                model = DistributedDataParallel(
                    config=self.tf_config, ddp_config=DistributedDataParallelConfig(**ddp_settings), module=model
                )
        module = [model]

        if self.engine_config.dist_checkpointing_path:
            with cuda_literals_on_cpu():
                load_mcore_dist_weights(
                    module, self.engine_config.dist_checkpointing_path, is_value_model=self.is_value_model
                )
        elif torch.distributed.get_rank() == 0:
            print("[verl-ds4 cpu] no engine.dist_checkpointing_path: the model keeps its builder's weights")
        if torch.distributed.get_rank() == 0:
            print_model_size(module[0])
        return module

    # -- optimizer, step, schedule, checkpoints -------------------------------------------

    def _build_optimizer(self):
        with cuda_literals_on_cpu(report_cuda_types=True):
            return super()._build_optimizer()

    def optimizer_step(self):
        with cuda_literals_on_cpu(report_cuda_types=True):
            return super().optimizer_step()

    def forward_backward_batch(self, *args, **kwargs):
        with cuda_literals_on_cpu():
            return super().forward_backward_batch(*args, **kwargs)

    def train_batch(self, data, loss_function):
        """verl's training step, plus one progress line on the logging rank (see :func:`verl_ds4.cpu.progress.progress_line`)."""
        start = time.perf_counter()
        outputs = super().train_batch(data, loss_function)
        self._report_progress(data, outputs, time.perf_counter() - start)
        return outputs

    def _report_progress(self, data, outputs, step_seconds: float) -> None:
        if not self.is_mp_src_rank_with_outputs():
            return
        from verl.utils import tensordict_utils as tu

        if not hasattr(self, "_progress_started"):
            self._progress_started = time.perf_counter() - step_seconds
            self._progress_tokens = 0
        self._progress_step = getattr(self, "_progress_step", 0) + 1
        seqlens = tu.get_non_tensor_data(data, key="global_token_num", default=None)
        tokens = int(sum(seqlens)) if seqlens is not None else 0
        self._progress_tokens += tokens
        loss = torch.tensor(float(sum(outputs.get("loss", []) or [0.0])), dtype=torch.float64)
        group = self.get_data_parallel_group()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG, group=group)
        if self.get_data_parallel_rank() == 0:
            from tqdm import tqdm

            # tqdm.write keeps the line above verl's progress bar instead of appending to it.
            tqdm.write(
                progress_line(
                    self._progress_step, loss.item(), tokens, step_seconds, time.perf_counter() - self._progress_started
                )
            )

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        # Everything already lives on the CPU; offload/onload are no-ops here.
        if device not in ("cpu",):
            raise ValueError(f"The CPU engine can only be moved to 'cpu', got {device!r}.")

    #: Megatron's async-save finalisation (verl_ds4.engine.checkpoint) makes CUDA tensors and syncs: on the CPU here.
    checkpoint_device_context = staticmethod(cuda_literals_on_cpu)

    def save_checkpoint(self, *args, **kwargs):
        with cuda_literals_on_cpu():
            return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, local_path, *args, **kwargs):
        step = global_step_of(local_path)
        if step is not None:
            self._progress_step = step
        if self.optimizer is not None:
            create_empty_optimizer_state(self.optimizer)
        # no_grad: Megatron's distributed optimizer copies loaded values into its fp32 main
        # parameters in place (views of leaves that require grad) without disabling autograd.
        with torch.no_grad(), cuda_literals_on_cpu():
            result = super().load_checkpoint(local_path, *args, **kwargs)
        if self.optimizer is not None:
            restore_adam_step_counters(self.optimizer)
        return result


# The CPU mixin sits *between* verl-ds4's DS4 engine and verl's engine in the MRO, so the DS4
# engine's steps (transformer-config fills, CP-layout resolution after the model is built, the
# active layout during ``forward_backward_batch``) wrap the CPU build and run steps.


class CPUMegatronEngineWithLMHead(DS4MegatronEngineWithLMHead, _CPUMegatronEngineMixin, MegatronEngineWithLMHead):
    """verl-ds4's Megatron LM-head engine (actor, reference, SFT) on the CPU."""

    sparse_attention_in_megatron = False  # the CPU models' own attention takes sparse_attention=linear

    accepts_fp32_params = True  # engine.dtype=float32 through CPUMcoreEngineConfig


class CPUMegatronEngineWithValueHead(
    DS4MegatronEngineWithValueHead, _CPUMegatronEngineMixin, MegatronEngineWithValueHead
):
    """verl-ds4's Megatron value-head engine (critic) on the CPU."""

    sparse_attention_in_megatron = False  # the CPU models' own attention takes sparse_attention=linear

    accepts_fp32_params = True


_REGISTERED = False


def register_cpu_engines() -> bool:
    """Register the CPU engines with verl's ``EngineRegistry`` for ``device="cpu"``.

    Idempotent; returns True if this call registered them. verl 0.9.1 has no CPU Megatron
    engine, so this adds keys and overrides nothing.
    """
    global _REGISTERED
    if _REGISTERED:
        return False
    from verl.workers.engine.base import EngineRegistry

    EngineRegistry.register(model_type="language_model", backend="megatron", device="cpu")(
        CPUMegatronEngineWithLMHead
    )
    EngineRegistry.register(model_type="value_model", backend="megatron", device="cpu")(
        CPUMegatronEngineWithValueHead
    )
    _REGISTERED = True
    return True


def _register_if_cpu_selected() -> None:
    """Loading this module with ``VERL_USE_EXTERNAL_MODULES`` under ``VERL_PLATFORM=cpu`` registers it."""
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
        register_cpu_engines()


_register_if_cpu_selected()
