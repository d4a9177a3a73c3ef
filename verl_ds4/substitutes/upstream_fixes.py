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
3. **MTP loss under CP: a mean over each rank's own tokens.** dev's ``process_mtp_loss`` (without
   ``calculate_per_token_loss``, verl's setting for static CP) hands each rank ``scale * sum(local loss) /
   local_tokens`` to the backward. verl's main loss on a CP rank is that rank's share of the global mean (its tokens'
   sum over the global count; Megatron's DDP then divides every gradient by the CP size alike), so the MTP term is
   weighted CP times more than at CP 1 against the main loss, and ragged ranks weight their tokens unequally: the
   MTP gradients summed over CP 2 ranks are 1.0 relative off CP 1 on a ragged batch (3e-15 with this fix). :func:`install_mtp_cp_token_share`
   makes it the rank's share of the CP-global mean (``sum(local loss) / global_tokens``, the rolled loss mask's count
   all-reduced over the CP group) at CP > 1, which is the CP 1 value summed over ranks; CP 1 and the per-token
   regime are untouched.
"""

from __future__ import annotations

import math

import torch

from .patching import Patches

__all__ = ["install_mtp_cp_token_share", "install_mtp_cp_token_share_for_process", "install_mtp_local_experts_mapping",
           "install_reference_mhc_rms", "megatron_mhc_rms_differs", "mtp_loss_is_rank_mean"]

#: What :func:`install_mtp_cp_token_share_for_process` patched (kept for the process's life; ``undo()`` restores).
PROCESS_PATCHES = Patches()


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


#: The lines of dev's ``process_mtp_loss`` that make its MTP loss a mean over the rank's own tokens (both proven commits).
_RANK_MEAN_LINES = ("num_tokens = loss_mask.sum()", "safe_num_tokens = num_tokens.clamp(min=1)",
                    "mtp_loss_scale * mtp_loss / safe_num_tokens")


def mtp_loss_is_rank_mean(function) -> bool:
    """Whether ``process_mtp_loss`` still normalises by the rank's own token count (the difference fix 3 corrects)."""
    import inspect

    try:
        source = " ".join(inspect.getsource(function).split())
    except (OSError, TypeError):
        return False
    return all(line in source for line in _RANK_MEAN_LINES)


def install_mtp_cp_token_share(patches: Patches) -> bool:
    """Fix 3 (module docstring): wrap dev's ``process_mtp_loss`` so that at CP > 1 (and without
    ``calculate_per_token_loss``) each rank's MTP loss is its share of the CP-global token mean. Returns False (and
    changes nothing) where dev has no ``process_mtp_loss`` or no longer normalises per rank.

    How, without a copy of dev's function: while the wrapped call runs, its module's ``roll_tensor`` records each
    rolled loss mask and its ``MTPLossAutoScaler`` rescales the per-token loss it is handed (dev's ``scale * loss /
    local_tokens``) by ``local_tokens / global_tokens``; both names are restored when the call returns (the autograd
    function's backward, which runs later, is dev's own)."""
    import importlib
    import inspect

    import torch.distributed as dist

    mtp = importlib.import_module("megatron.core.transformer.multi_token_prediction")
    original = getattr(mtp, "process_mtp_loss", None)
    if original is None or getattr(original, "_verl_ds4_cp_token_share", False):
        return False
    if not mtp_loss_is_rank_mean(original):
        return False
    signature = inspect.signature(original)

    class _Scaler:
        def __init__(self, scaler, masks, group):
            self.scaler, self.masks, self.group = scaler, masks, group

        def apply(self, output, per_token_loss):
            local = self.masks[-1].sum().to(per_token_loss.dtype)
            total = local.detach().clone()
            dist.all_reduce(total, group=self.group)
            return self.scaler.apply(output, per_token_loss * (local.clamp(min=1) / total.clamp(min=1)))

    def process_mtp_loss(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        config, group = bound.arguments.get("config"), bound.arguments.get("cp_group")
        if config is None or config.calculate_per_token_loss or group is None or dist.get_world_size(group) == 1:
            return original(*args, **kwargs)
        roll, scaler, masks = mtp.roll_tensor, mtp.MTPLossAutoScaler, []

        def recording_roll(tensors, *a, **k):
            rolled = roll(tensors, *a, **k)
            masks.append(rolled[1])  # [labels or input_ids, loss_mask]: the loss mask of this depth
            return rolled

        mtp.roll_tensor, mtp.MTPLossAutoScaler = recording_roll, _Scaler(scaler, masks, group)
        try:
            return original(*args, **kwargs)
        finally:
            mtp.roll_tensor, mtp.MTPLossAutoScaler = roll, scaler

    process_mtp_loss._verl_ds4_cp_token_share = True
    process_mtp_loss.__wrapped__ = original
    import sys

    # every module that imported the function by name (gpt_model, hybrid_model, verl's mtp_patch) calls the wrapper
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is original:
                patches.set(module, name, process_mtp_loss)
    return True


def install_mtp_cp_token_share_for_process() -> bool:
    """Fix 3 for the rest of the process (verl-ds4's GPU DS4 engines at CP > 1, at start-up), recorded in
    :data:`PROCESS_PATCHES`; False where no Megatron with ``multi_token_prediction`` is importable, the fix is in
    place already, or dev no longer normalises per rank."""
    try:
        import megatron.core.transformer.multi_token_prediction  # noqa: F401
    except ImportError:
        return False
    return install_mtp_cp_token_share(PROCESS_PATCHES)
