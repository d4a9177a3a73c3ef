"""The registry of CPU model builders, by Hugging Face ``model_type``, and the settings a CPU build needs.

Builders live with their CPU models and register on import (:mod:`verl_ds4.cpu.ds4_builder`:
``deepseek_v4``; :mod:`verl_ds4.cpu.tiny_dense`: ``llama``); the CPU engine picks one by the
model folder's ``model_type``. Select the module with verl's per-model knob ``model.external_lib``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["CPU_MODEL_BUILDERS", "CPUModelBuilder", "cpu_transformer_overrides", "register_cpu_model_builder"]


@dataclass(frozen=True)
class CPUModelBuilder:
    """How to build a CPU-runnable Megatron model for one HF ``model_type``.

    ``transformer_config(hf_config, dtype, overrides) -> TransformerConfig``;
    ``build(tf_config, hf_config, *, pre_process, post_process, share_embeddings) -> GPTModel``.
    ``builds_value_head``: ``build`` also takes ``value_head=`` and builds verl's critic itself
    (otherwise the engine puts its own hidden -> 1 head in place of ``output_layer``).
    """

    transformer_config: Callable[..., Any]
    build: Callable[..., Any]
    builds_value_head: bool = False


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
