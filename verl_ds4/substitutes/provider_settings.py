"""The provider settings a CPU needs beside verl's own overrides (the "fused kernels" substitute of the registry).

Megatron-Bridge's DS4 provider turns on rope / permute fusion, TransformerEngine cross-entropy, shared-expert overlap,
gradient-accumulation fusion and grouped GEMM: each a CUDA or TransformerEngine kernel. On a CPU the same settings
select Megatron's unfused paths (the same math), CPU initialisation, SequentialMLP experts and Megatron's local
modules. verl passes them to the provider through ``engine.override_transformer_config``; the proofs add them to
verl's overrides (:mod:`verl_ds4.verify.production`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CPU_OVERRIDES"]

CPU_OVERRIDES: dict[str, Any] = {
    "use_cpu_initialization": True,
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "moe_permute_fusion": False,
    "moe_grouped_gemm": False,
    "moe_shared_expert_overlap": False,
    "cross_entropy_loss_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "use_fused_mhc": False,
    "apply_dsa_kernel_fusion": False,
}
