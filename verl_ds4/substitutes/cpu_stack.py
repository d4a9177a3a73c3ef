"""Prototype: the CPU substitutes applied to Megatron-LM dev + Megatron-Bridge (split into modules once it runs)."""

from __future__ import annotations

import importlib
import sys
import types

import torch


# ------------------------------------------------------------------ import-time stand-ins


class _NoOp(types.ModuleType):
    """A module whose every attribute is a no-op decorator / callable (lets triton kernels *define*)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _noop


def _noop(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return _noop


TRITON_NAMES = ("triton", "triton.language", "triton.language.extra", "triton.runtime")


class _Placeholder(type):
    """A class whose every attribute is another placeholder class (annotations such as ``te.ops.Sequential``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Placeholder(name, (), {"__module__": cls.__module__})
        setattr(cls, name, sub)
        return sub


class _TEPlaceholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _Placeholder(name, (), {"__module__": self.__name__})
        setattr(self, name, cls)
        return cls


#: megatron.core modules Megatron-Bridge imports: imported before the TransformerEngine placeholder is visible,
#: so each decides ``HAVE_TE`` against the real environment.
MEGATRON_CORE_BEFORE_BRIDGE = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.models.hybrid.hybrid_model",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.T5.t5_model",
    "megatron.core.models.vision.radio",
    "megatron.core.post_training.modelopt.gpt.model_specs",
    "megatron.core.post_training.modelopt.hybrid.model_specs",
    "megatron.core.resharding",
    "megatron.core.resharding.refit",
    "megatron.core.ssm.gated_delta_net",
    "megatron.core.ssm.mamba_mixer",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.experimental_attention_variant.deepseek_v4_hybrid_attention",
    "megatron.core.transformer.experimental_attention_variant.csa",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.optimizer.qk_clip",
    "megatron.core.optimizer.optimizer_cuda_graph",
    "megatron.core.fault_injector",
    "megatron.core.energy_monitor",
    "megatron.core.datasets.data_schedule",
    "megatron.core.tokenizers.utils.build_tokenizer",
    "megatron.core.pipeline_parallel.hybrid_cp_schedule",
    "megatron.core.extensions.kitchen",
    "megatron.core.transformer.linear_cross_entropy",
    "megatron.core.inference.contexts.attention_context.triton.tensor_ops",
    "megatron.core.datasets.utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.models.vision.vit_layer_specs",
    "megatron.core.ssm.mamba_hybrid_layer_allocation",
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "megatron.core.transformer.moe.router_trace",
    "megatron.core.transformer.moe.upcycling_utils",
)


def import_megatron_dev():
    """Import dev's megatron.core with a no-op triton visible during the import only."""
    have_triton = importlib.util.find_spec("triton") is not None
    if not have_triton:
        for name in ("torch._dynamo", "functorch.compile", "torch._inductor.compile_fx"):
            importlib.import_module(name)  # torch's own probes see triton as absent
        for name in TRITON_NAMES:
            sys.modules[name] = _NoOp(name)
        sys.modules["triton"].language = sys.modules["triton.language"]
        sys.modules["triton"].__version__ = "3.4.0"
    try:
        for name in MEGATRON_CORE_BEFORE_BRIDGE:
            importlib.import_module(name)
    finally:
        if not have_triton:
            for name in TRITON_NAMES:
                sys.modules.pop(name, None)


def import_bridge():
    """Import megatron.bridge with a TransformerEngine placeholder visible during the import only."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return importlib.import_module("megatron.bridge")
    before = set(sys.modules)
    te = _TEPlaceholder("transformer_engine")
    te.pytorch = _TEPlaceholder("transformer_engine.pytorch")
    sys.modules["transformer_engine"] = te
    sys.modules["transformer_engine.pytorch"] = te.pytorch
    have_triton = importlib.util.find_spec("triton") is not None
    if not have_triton:
        for name in TRITON_NAMES:
            sys.modules[name] = _NoOp(name)
        sys.modules["triton"].language = sys.modules["triton.language"]
    try:
        bridge = importlib.import_module("megatron.bridge")
    finally:
        sys.modules.pop("transformer_engine", None)
        sys.modules.pop("transformer_engine.pytorch", None)
        if not have_triton:
            for name in TRITON_NAMES:
                sys.modules.pop(name, None)
    late = sorted(m for m in set(sys.modules) - before if m.startswith("megatron.core"))
    if late:
        raise RuntimeError(f"megatron.core modules imported while the TransformerEngine placeholder was visible: {late}")
    return bridge


# ------------------------------------------------------------------ TE modules -> local


class LocalLinear(torch.nn.Module):
    """A replicated linear (TE's ``TELinear(parallel_mode='duplicated')``): ``(y, None)``."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=False, skip_bias_add=False, **_ignored):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        self.bias = None
        self.skip_bias_add = skip_bias_add

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None

    def backward_dw(self):
        return None


def local_backend_provider(config=None):
    from megatron.core.models.backends import LocalSpecProvider

    class CPUSpecProvider(LocalSpecProvider):
        def linear(self):
            return LocalLinear

    return CPUSpecProvider()


class _Hadamard(torch.autograd.Function):
    _cache: dict = {}

    @staticmethod
    def matrix(n, dtype, device):
        key = (n, dtype, str(device))
        if key not in _Hadamard._cache:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < n:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
            _Hadamard._cache[key] = h.to(dtype=dtype, device=device)
        return _Hadamard._cache[key]

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return (x @ _Hadamard.matrix(x.shape[-1], x.dtype, x.device)) * scale

    @staticmethod
    def backward(ctx, grad):
        return (grad @ _Hadamard.matrix(grad.shape[-1], grad.dtype, grad.device)) * ctx.scale, None


def rotate_activation(x):
    return _Hadamard.apply(x, x.size(-1) ** -0.5)


class CPUEvent:
    """A CUDA event on the CPU: work is done in order, so it has always happened."""

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True


class CPUStream:
    """A CUDA stream on the CPU: nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or CPUEvent()

    def wait_event(self, event):
        return None

    def wait_stream(self, stream):
        return None

    def synchronize(self):
        return None


def install_runtime():
    """Everything after import (prototype: not undoable)."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None

    class _Range:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    torch.cuda.nvtx.range = _Range
    import contextlib

    torch.cuda.Stream = CPUStream
    torch.cuda.Event = CPUEvent
    torch.cuda.current_stream = lambda *a, **k: CPUStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.transformer import transformer_config as tc
    from megatron.core.transformer.experimental_attention_variant import csa, dsa
    from megatron.core.transformer.experimental_attention_variant import deepseek_v4_hybrid_attention as dha

    specs._get_backend_spec_provider = local_backend_provider
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    AutoMapping.register_module_type("LocalLinear", "replicated")
    from megatron.core.models.gpt import gpt_layer_specs as gls

    def mtp_block_spec(config, spec, use_transformer_engine, vp_stage=None, pp_rank=None):
        return gls.get_gpt_mtp_block_spec_for_backend(config=config, spec=spec, backend=local_backend_provider(config),
                                                      vp_stage=vp_stage, pp_rank=pp_rank)

    gls.get_gpt_mtp_block_spec = mtp_block_spec
    dha.TELinear = LocalLinear
    dsa.rotate_activation = rotate_activation
    csa.rotate_activation = rotate_activation
    original = tc.is_te_min_version
    tc.is_te_min_version = lambda v, *a, **k: True if v == "2.9.0" else original(v, *a, **k)


def install_bridge_mtp_local_experts():
    """Megatron-Bridge 0.6.2's DS4 bridge maps SequentialMLP experts (``local_experts``) of the decoder layers but
    not of the MTP layers; add those mappings when the registry lacks them (a guarded fix)."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from megatron.bridge.models.deepseek.deepseek_v4_bridge import DeepSeekV4Bridge

    original = DeepSeekV4Bridge.mapping_registry

    def mapping_registry(self):
        registry = original(self)
        extra = []
        for k in range(int(getattr(self.hf_config, "num_nextn_predict_layers", 0) or 0)):
            mg = f"mtp.layers.{k}.mtp_model_layer.mlp.experts.local_experts"
            if registry.megatron_to_hf_lookup(f"{mg}.0.linear_fc1.weight") is not None:
                continue
            extra += [GatedMLPMapping(megatron_param=f"{mg}.*.linear_fc1.weight", gate=f"mtp.{k}.ffn.experts.*.w1.weight",
                                      up=f"mtp.{k}.ffn.experts.*.w3.weight"),
                      AutoMapping(f"{mg}.*.linear_fc2.weight", f"mtp.{k}.ffn.experts.*.w2.weight")]
        return MegatronMappingRegistry(*registry.mappings, *extra) if extra else registry

    DeepSeekV4Bridge.mapping_registry = mapping_registry
