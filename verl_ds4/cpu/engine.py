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
``verl_ds4.cpu.ds4_builder`` (``deepseek_v4``: the tiny DS4 proxy) or
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
  given, else a seeded random initialisation (a CPU proxy has no HF weights).
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

Not supported on CPU (raises): LoRA/PEFT, HF-format model save/load (needs a bridge), fused
kernels, Megatron FSDP, pipeline/virtual-pipeline parallelism, ``param_offload``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

from verl_ds4.engine.config import DS4McoreEngineConfig
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


# ---------------------------------------------------------------------------------------
# Engine config: verl's, plus full fp32 parameters
# ---------------------------------------------------------------------------------------

_FP32_NAMES = ("float32", "fp32")


@dataclass
class CPUMcoreEngineConfig(DS4McoreEngineConfig):
    """verl-ds4's engine config (verl's ``McoreEngineConfig`` + ``cp_balance``) that also accepts
    ``dtype: float32`` (CPU engine only).

    verl 0.9.1's Megatron engine config admits only ``bfloat16``/``float16`` parameters, the
    right choice on GPUs. On a CPU, fp32 parameters and compute are what make runs at
    different CP sizes comparable to fp32 tolerance (bf16 rounds differently when the same
    tokens are summed on one rank or two), and fp32 matmuls are no slower there. Select it
    with ``engine._target_=verl_ds4.cpu.engine.CPUMcoreEngineConfig engine.dtype=float32``;
    every other field and check is verl's. The DS4 GPU engines refuse an fp32 config
    (:meth:`verl_ds4.engine.megatron.DS4MegatronEngineWithLMHead`), so it cannot reach them
    unnoticed.
    """

    _mutable_fields = DS4McoreEngineConfig._mutable_fields | {"dtype"}

    def __post_init__(self) -> None:
        requested = self.dtype
        if requested not in _FP32_NAMES:
            super().__post_init__()
            return
        # verl's own checks, run on a half-precision stand-in, then the requested value back.
        self.dtype = "bfloat16"
        try:
            super().__post_init__()
        finally:
            self.dtype = "float32"


# ---------------------------------------------------------------------------------------
# CUDA literals inside Megatron-Core, redirected to the CPU for the duration of a call
# ---------------------------------------------------------------------------------------


def _is_accelerator_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means "cuda:<index>" to torch factory functions
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaLiteralsToCPU(TorchFunctionMode):
    """Torch-function mode: ``device="cuda"``/index arguments become ``"cpu"``.

    Also makes ``tensor.cuda()`` return the CPU tensor itself and, with
    ``report_cuda_types``, ``tensor.type()`` name a CPU float tensor by its CUDA type
    (Megatron's optimizers assert ``param.type() == 'torch.cuda.FloatTensor'``).
    """

    def __init__(self, report_cuda_types: bool):
        super().__init__()
        self.report_cuda_types = report_cuda_types

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_accelerator_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda and args and args[0].device.type == "cpu":
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_accelerator_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if self.report_cuda_types and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_literals_on_cpu(report_cuda_types: bool = False):
    """Run Megatron-Core code that hard-codes CUDA on the CPU.

    Inside the block: tensors requested on ``"cuda"`` (or a device index) are created on the
    CPU, ``torch.cuda.current_device()`` returns 0 (then mapped to the CPU),
    ``torch.cuda.synchronize()`` does nothing. Only the CPU engines use it, around the
    Megatron calls listed in this module's docstring; it is a no-op for code that does not
    name CUDA.
    """
    saved = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize")}
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        with _CudaLiteralsToCPU(report_cuda_types):
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


# ---------------------------------------------------------------------------------------
# Megatron's model-parallel RNG tracker on the CPU generator
# ---------------------------------------------------------------------------------------


class CPURNGStatesTracker:
    """Megatron ``CudaRNGStatesTracker`` interface over torch's CPU generator.

    ``add(name, seed)`` records a generator state seeded with ``seed``; ``fork(name)`` swaps
    it into torch's default CPU generator for the block and stores it back afterwards;
    ``get_states``/``set_states`` carry the states through checkpoints.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the CPU RNG tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_rng_tracker(seed: int) -> CPURNGStatesTracker:
    """Replace Megatron's CUDA RNG tracker with a seeded :class:`CPURNGStatesTracker`.

    Seeds follow Megatron's ``model_parallel_cuda_manual_seed`` scheme (an offset per TP
    rank for the model-parallel stream, per EP/ETP rank for the expert stream) so every
    rank draws what it would draw on a GPU mesh of the same shape.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CPURNGStatesTracker()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    ep_rank = mpu.get_expert_model_parallel_rank()
    etp_rank = mpu.get_expert_tensor_parallel_rank()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * ep_rank + etp_rank + 1)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


# ---------------------------------------------------------------------------------------
# CPU model builders (by HF model_type)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CPUModelBuilder:
    """How to build a CPU-runnable Megatron model for one HF ``model_type``.

    ``transformer_config(hf_config, dtype, overrides) -> TransformerConfig``;
    ``build(tf_config, hf_config, *, pre_process, post_process, share_embeddings) -> GPTModel``.
    """

    transformer_config: Callable[..., Any]
    build: Callable[..., Any]


CPU_MODEL_BUILDERS: dict[str, CPUModelBuilder] = {}


def register_cpu_model_builder(model_type: str, builder: CPUModelBuilder) -> None:
    """Register (or replace) the CPU model builder for an HF ``model_type``."""
    CPU_MODEL_BUILDERS[model_type] = builder


# Settings a CPU build needs: (value, reason). A user override that differs is an error.
_CPU_TRANSFORMER_SETTINGS: dict[str, tuple[Any, str]] = {
    "use_cpu_initialization": (True, "Megatron would allocate parameters on CUDA"),
    "gradient_accumulation_fusion": (False, "needs the CUDA fused weight-gradient kernel"),
    "apply_rope_fusion": (False, "needs TransformerEngine/apex kernels"),
    "masked_softmax_fusion": (False, "needs a CUDA kernel"),
    "persist_layer_norm": (False, "needs apex"),
    "attention_dropout": (0.0, "the pure-PyTorch CPU attention has no dropout"),
}


def cpu_transformer_overrides(user_overrides: dict[str, Any]) -> dict[str, Any]:
    """``user_overrides`` plus the CPU settings; raises if the user set one differently."""
    merged = dict(user_overrides)
    for key, (value, reason) in _CPU_TRANSFORMER_SETTINGS.items():
        if key in merged and merged[key] != value:
            raise ValueError(
                f"engine.override_transformer_config.{key}={merged[key]!r} cannot run on CPU ({reason}); "
                f"remove the override or set it to {value!r}."
            )
        merged[key] = value
    return merged


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

    def _validate_cpu_engine_config(self) -> None:
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
        if not ec.forward_only and not ec.use_dist_checkpointing:
            problems.append(
                "HF-format checkpoints (they need a Megatron bridge): set engine.use_dist_checkpointing=True "
                "(with dist_checkpointing_path unset, the model starts from a seeded random init)"
            )
        if problems:
            raise ValueError("The CPU Megatron engine does not support: " + "; ".join(problems) + ".")

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
                "DS4 proxy, deepseek_v4) or verl_ds4.cpu.tiny_dense (the tiny dense model, llama); or call "
                "verl_ds4.cpu.engine.register_cpu_model_builder()."
            )
        self._cpu_model_builder = builder
        overrides = cpu_transformer_overrides(
            mapping_string_to_attn_backend(dict(self.engine_config.override_transformer_config or {}))
        )
        tf_config = builder.transformer_config(self.model_config.hf_config, self.param_dtype, overrides)
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
        model = self._cpu_model_builder.build(
            self.tf_config,
            hf_config,
            pre_process=True,
            post_process=True,
            share_embeddings=self.share_embeddings_and_output_weights,
        )
        if self.is_value_model:
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
            print("[verl-ds4 cpu] no engine.dist_checkpointing_path: model starts from a seeded random init")
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
        """verl's training step, plus one progress line on the logging rank (see :func:`_progress_line`)."""
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
                _progress_line(
                    self._progress_step, loss.item(), tokens, step_seconds, time.perf_counter() - self._progress_started
                )
            )

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        # Everything already lives on the CPU; offload/onload are no-ops here.
        if device not in ("cpu",):
            raise ValueError(f"The CPU engine can only be moved to 'cpu', got {device!r}.")

    def save_checkpoint(self, *args, **kwargs):
        with cuda_literals_on_cpu():
            return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, local_path, *args, **kwargs):
        step = _global_step_of(local_path)
        if step is not None:
            self._progress_step = step
        if self.optimizer is not None:
            _create_empty_optimizer_state(self.optimizer)
        # no_grad: Megatron's distributed optimizer copies loaded values into its fp32 main
        # parameters in place (views of leaves that require grad) without disabling autograd.
        with torch.no_grad(), cuda_literals_on_cpu():
            result = super().load_checkpoint(local_path, *args, **kwargs)
        if self.optimizer is not None:
            _restore_adam_step_counters(self.optimizer)
        return result


def _progress_line(step: int, loss: float, tokens: int, step_seconds: float, elapsed: float) -> str:
    """``[verl-ds4] step 12 | loss 2.3412 | 1840 tok/s | elapsed 35.2s`` (tokens of the global batch)."""
    rate = tokens / step_seconds if step_seconds > 0 else float("nan")
    return f"[verl-ds4] step {step} | loss {loss:.4f} | {rate:.0f} tok/s | elapsed {elapsed:.1f}s"


def _global_step_of(path) -> int | None:
    """N for a verl checkpoint folder ``.../global_step_N``, else None."""
    name = os.path.basename(os.path.normpath(str(path))) if path else ""
    prefix = "global_step_"
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def _inner_torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in _inner_torch_optimizers(opt)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def _create_empty_optimizer_state(optimizer) -> None:
    """Give every Adam parameter a zero state (``step=0``, zero moments) if it has none.

    Megatron's distributed optimizer reads ``state['step']`` while building the state dict
    that a checkpoint is loaded into; torch's Adam only creates it on the first step. The
    loaded checkpoint overwrites these values. Parameters are not touched.
    """
    for inner in _inner_torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))
                    if group.get("amsgrad"):
                        state.setdefault("max_exp_avg_sq", torch.zeros_like(param))


def _restore_adam_step_counters(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor, set to the checkpoint's step.

    Without TransformerEngine/Apex, Megatron-Core 0.16's ``DistributedOptimizer`` stores the
    Adam step in each checkpointed param group (``param_group["step"]``) and on load assigns
    *one* tensor object to every parameter's ``state["step"]``; the per-parameter state copy
    that follows then writes the pre-load placeholder into that shared tensor, and torch's
    Adam would increment it in place once per parameter. Both would change every bias
    correction after a resume. The loaded param groups keep the true value.
    """
    for inner in _inner_torch_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            if group["step"] is None:
                continue
            step = float(group["step"])
            for param in group["params"]:
                state = inner.state.get(param)
                if state is not None and "step" in state:
                    state["step"] = torch.tensor(step, dtype=torch.float32)


# The CPU mixin sits *between* verl-ds4's DS4 engine and verl's engine in the MRO, so the DS4
# engine's steps (transformer-config fills, CP-layout resolution after the model is built, the
# active layout during ``forward_backward_batch``) wrap the CPU build and run steps.


class CPUMegatronEngineWithLMHead(DS4MegatronEngineWithLMHead, _CPUMegatronEngineMixin, MegatronEngineWithLMHead):
    """verl-ds4's Megatron LM-head engine (actor, reference, SFT) on the CPU."""

    accepts_fp32_params = True  # engine.dtype=float32 through CPUMcoreEngineConfig


class CPUMegatronEngineWithValueHead(
    DS4MegatronEngineWithValueHead, _CPUMegatronEngineMixin, MegatronEngineWithValueHead
):
    """verl-ds4's Megatron value-head engine (critic) on the CPU."""

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
