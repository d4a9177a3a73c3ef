"""Differences between Megatron-LM ``dev`` / Megatron-Bridge 0.6.2 and the DS4 reference, and their guarded fixes.

Each fix first checks that the upstream code still has the difference (so it turns itself off once upstream
changes), and each is listed in :data:`verl_ds4.substitutes.registry.UPSTREAM_FIXES` with its reproduction.

1. **Bridge: MTP experts as SequentialMLP have no mapping.** The DS4 bridge maps ``local_experts`` (SequentialMLP,
   the experts without grouped GEMM) for decoder layers but only grouped-GEMM names for the MTP layers, so loading a
   folder into a model with ``moe_grouped_gemm=False`` (any non-TransformerEngine build) ends in
   ``AttributeError: 'NoneType' object has no attribute 'megatron_module'`` in ``load_weights_hf_to_megatron``.
   :func:`install_mtp_local_experts_mapping` adds the two missing mappings (``w1``/``w3`` -> ``linear_fc1``, ``w2`` ->
   ``linear_fc2``), built from Bridge's own mapping classes, when the registry lacks them.
2. **mHC's RMS factor.** DeepSeek's reference and transformers scale the mHC mapping input by
   ``rsqrt(mean(x^2) + eps)``; dev's unfused ``hyper_connection.native_proj_rms`` by ``1 / (||x|| / sqrt(K) + eps)``
   (eps outside the square root). Relative difference about ``eps / rms`` (5e-7 at rms 1, 1.8e-5 in the tiny model's
   logits, where activations are small). :func:`install_reference_mhc_rms` replaces it by the reference form for the
   float64 proofs only; a GPU run keeps Megatron's (the difference is far below bf16 resolution).
"""

from __future__ import annotations

import math

import torch

from .patching import Patches

__all__ = ["install_mtp_local_experts_mapping", "install_reference_mhc_rms", "megatron_mhc_rms_differs"]


def install_mtp_local_experts_mapping(patches: Patches) -> bool:
    """Fix 1. Returns whether the bridge needed it (False: upstream maps MTP SequentialMLP experts itself)."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from megatron.bridge.models.deepseek.deepseek_v4_bridge import DeepSeekV4Bridge

    original = DeepSeekV4Bridge.mapping_registry

    def mapping_registry(self):
        registry = original(self)
        extra = []
        for k in range(int(getattr(self.hf_config, "num_nextn_predict_layers", 0) or 0)):
            megatron = f"mtp.layers.{k}.mtp_model_layer.mlp.experts.local_experts"
            if registry.megatron_to_hf_lookup(f"{megatron}.0.linear_fc1.weight") is not None:
                continue
            extra += [
                GatedMLPMapping(megatron_param=f"{megatron}.*.linear_fc1.weight", gate=f"mtp.{k}.ffn.experts.*.w1.weight",
                                up=f"mtp.{k}.ffn.experts.*.w3.weight"),
                AutoMapping(f"{megatron}.*.linear_fc2.weight", f"mtp.{k}.ffn.experts.*.w2.weight"),
            ]
        return MegatronMappingRegistry(*registry.mappings, *extra) if extra else registry

    patches.set(DeepSeekV4Bridge, "mapping_registry", mapping_registry)
    return True


def reference_proj_rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """The mHC projection and its RMS factor as DeepSeek's reference computes them: ``rsqrt(mean(x^2) + eps)``."""
    return torch.matmul(x, weight.t()), torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def megatron_mhc_rms_differs() -> float:
    """The relative difference of dev's ``native_proj_rms`` factor from the reference on a small-norm probe (0.0:
    upstream computes the reference form)."""
    from megatron.core.transformer import hyper_connection

    x = torch.full((1, 16), 1e-3, dtype=torch.float64)
    w = torch.eye(16, dtype=torch.float64)
    _, theirs = hyper_connection.native_proj_rms(x, w, 1e-6)
    _, ours = reference_proj_rms(x, w, 1e-6)
    return float(((theirs - ours).abs() / ours.abs()).max())


def install_reference_mhc_rms(patches: Patches) -> bool:
    """Fix 2 (float64 proofs). Returns whether dev differed (False: nothing installed)."""
    from megatron.core.transformer import hyper_connection

    if megatron_mhc_rms_differs() < 1e-12:
        return False
    assert math.isfinite(megatron_mhc_rms_differs())
    patches.set(hyper_connection, "native_proj_rms", reference_proj_rms)
    return True
