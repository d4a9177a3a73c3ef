"""Importing Megatron-LM ``dev`` and Megatron-Bridge on a machine without triton or TransformerEngine.

Two import-time stand-ins, each visible only while the import runs and removed right after:

* **triton**: dev's ``megatron/core`` imports triton at module level (MoE paged stash, CSA teacher LSE, the SSM
  ops) although the CPU path never launches those kernels. While :func:`import_megatron_dev` imports
  :data:`MEGATRON_CORE_MODULES`, ``triton`` is a module whose every attribute is a no-op decorator, so the kernels
  *define* and are never called. torch's own probes run first, so torch sees triton as absent.
* **transformer_engine**: ``import megatron.bridge`` imports ``transformer_engine.pytorch`` unguarded
  (``peft/lora_layers.py``), though it uses ``te`` only inside functions and annotations. While
  :func:`import_bridge` imports it, ``transformer_engine`` is a placeholder whose attributes are empty classes.
  Every ``megatron.core`` module the bridge needs is imported before (:data:`MEGATRON_CORE_MODULES`), so each
  decides ``HAVE_TE`` against the real environment; a ``megatron.core`` module first imported while the placeholder
  is visible is an error that names it (the list must grow), never a silent TE-enabled import.

Where the real package is importable, neither stand-in is used.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

__all__ = ["MEGATRON_CORE_MODULES", "SubstituteImportError", "import_bridge", "import_megatron_dev", "triton_stand_in"]

#: The megatron.core modules the production path and Megatron-Bridge import (their import closure covers the rest).
MEGATRON_CORE_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.models.hybrid.hybrid_model",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.T5.t5_model",
    "megatron.core.models.vision.radio",
    "megatron.core.models.vision.vit_layer_specs",
    "megatron.core.post_training.modelopt.gpt.model_specs",
    "megatron.core.post_training.modelopt.hybrid.model_specs",
    "megatron.core.resharding.refit",
    "megatron.core.ssm.gated_delta_net",
    "megatron.core.ssm.mamba_mixer",
    "megatron.core.ssm.mamba_hybrid_layer_allocation",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.transformer.hyper_connection",
    "megatron.core.transformer.experimental_attention_variant.deepseek_v4_hybrid_attention",
    "megatron.core.transformer.experimental_attention_variant.csa",
    "megatron.core.transformer.experimental_attention_variant.csa_utils.cp_layout_kernels",
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "megatron.core.transformer.moe.router_trace",
    "megatron.core.transformer.moe.upcycling_utils",
    "megatron.core.transformer.linear_cross_entropy",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.optimizer.qk_clip",
    "megatron.core.optimizer.optimizer_cuda_graph",
    "megatron.core.fault_injector",
    "megatron.core.energy_monitor",
    "megatron.core.datasets.data_schedule",
    "megatron.core.datasets.utils",
    "megatron.core.tokenizers.utils.build_tokenizer",
    "megatron.core.pipeline_parallel.hybrid_cp_schedule",
    "megatron.core.extensions.kitchen",
    "megatron.core.inference.contexts.attention_context.triton.tensor_ops",
)

TRITON_NAMES = ("triton", "triton.language", "triton.language.extra", "triton.runtime")
TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


class SubstituteImportError(ImportError):
    """An import stand-in would have leaked into a module that decides what it runs from it."""


class _NoOpModule(types.ModuleType):
    """Every attribute is a no-op decorator / callable: triton kernels define, and are never launched."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)  # error-catalogue: internal (attribute protocol of a stand-in module)
        return _noop


def _noop(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]  # used as a decorator: the function itself
    return _noop


class _PlaceholderClass(type):
    """A class whose attributes are further placeholder classes (``te.ops.Sequential`` in an annotation)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)  # error-catalogue: internal (attribute protocol of a stand-in module)
        sub = _PlaceholderClass(name, (), {"__module__": cls.__module__})
        setattr(cls, name, sub)
        return sub


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)  # error-catalogue: internal (attribute protocol of a stand-in module)
        cls = _PlaceholderClass(name, (), {"__module__": self.__name__})
        setattr(self, name, cls)
        return cls


def _missing(name: str) -> bool:
    return name not in sys.modules and importlib.util.find_spec(name) is None


@contextlib.contextmanager
def _visible(modules: dict[str, types.ModuleType]):
    """Put ``modules`` into ``sys.modules`` for the block, then take them out again."""
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)


def _no_op_triton() -> dict[str, types.ModuleType]:
    if not _missing("triton"):
        return {}
    for name in ("torch._dynamo", "functorch.compile", "torch._inductor.compile_fx"):
        importlib.import_module(name)  # torch's probes run now, with no triton visible
    modules = {name: _NoOpModule(name) for name in TRITON_NAMES}
    modules["triton"].language = modules["triton.language"]
    modules["triton"].__version__ = "3.4.0"
    return modules


def triton_stand_in():
    """A context in which ``import triton`` finds the no-op module when triton is not installed (nothing otherwise);
    use it around an import of dev's modules (:func:`import_megatron_dev` does)."""
    return _visible(_no_op_triton())


def import_megatron_dev() -> None:
    """Import :data:`MEGATRON_CORE_MODULES` (dev's tree must be first on ``sys.path``), triton stood in if absent."""
    with triton_stand_in():
        for name in MEGATRON_CORE_MODULES:
            importlib.import_module(name)


def import_bridge() -> types.ModuleType:
    """``import megatron.bridge``, with a TransformerEngine placeholder during the import when TE is absent."""
    import_megatron_dev()
    if not _missing("transformer_engine"):
        return importlib.import_module("megatron.bridge")
    placeholders = {name: _PlaceholderModule(name) for name in TE_NAMES}
    placeholders["transformer_engine"].pytorch = placeholders["transformer_engine.pytorch"]
    before = set(sys.modules)
    with _visible({**placeholders, **_no_op_triton()}):
        bridge = importlib.import_module("megatron.bridge")
    late = sorted(m for m in set(sys.modules) - before if m.startswith("megatron.core"))
    if late:
        raise SubstituteImportError(
            f"Megatron-Bridge imported megatron.core modules while the TransformerEngine placeholder was visible: {late}. "
            "They may have decided that TransformerEngine is installed; add them to "
            "verl_ds4.substitutes.imports.MEGATRON_CORE_MODULES so they are imported before it.")
    return bridge
