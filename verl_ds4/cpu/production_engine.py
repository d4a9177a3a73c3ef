"""verl's own Megatron engine build on the CPU, with the production model: Megatron-LM ``dev``'s DeepSeek-V4 built by
Megatron-Bridge's provider (what a GPU run executes).

The default CPU engines (:mod:`verl_ds4.cpu.engine`) replace verl's ``_build_tf_config`` / ``_build_megatron_module``
with the project's own model builder. The engines here do not: verl 0.9.1's non-vanilla bridge branch runs unchanged
(``AutoBridge.from_hf_pretrained`` -> ``to_megatron_provider(load_weights=False)`` ->
``apply_overrides_and_finalize(dtype, provider_overrides)`` -> ``make_megatron_module`` ->
``provider.provide_distributed_model`` -> ``bridge.load_hf_weights``). The CPU needs are met by

1. the CPU substitutes (:func:`verl_ds4.substitutes.registry.install_all`), installed when this module is imported,
   after Megatron-LM dev was put first on ``sys.path`` (:func:`verl_ds4.substitutes.megatron_dev.use`; the import
   refuses a process that already imported another ``megatron.core``);
2. provider settings passed through verl's own ``engine.override_transformer_config``
   (:func:`production_overrides`: :data:`verl_ds4.substitutes.provider_settings.CPU_OVERRIDES` and a ``dsa_indexer_loss_coeff``
   of 0.0 where it is unset); a user's contradicting explicit value is an error, never replaced;
3. the CPU engine mixin's steps for what Megatron's optimizer / DDP / schedule hard-code (CUDA literals, the CPU RNG
   tracker, fp32 through ``CPUMcoreEngineConfig``); verl's two build methods run inside
   :func:`verl_ds4.substitutes.cuda_literals.cuda_literals_on_cpu` (Bridge's ``get_model`` resets the provider's
   ``use_cpu_initialization`` to ``provide_distributed_model``'s argument, which verl does not pass, and then calls
   ``.cuda()``: inside the block both land on the CPU).

Selection: the engines are registered for ``device="cpu"`` under vendor :data:`VENDOR` (``"production"``); verl's
own knob ``VERL_ENGINE_VENDOR=production`` picks them, and without it the default CPU engines stay selected. Load
this module with ``VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,verl_ds4.cpu.production_engine`` (under
``VERL_PLATFORM=cpu`` it registers itself) before anything imports megatron. The model folder must be a DeepSeek-V4
HF folder in DeepSeek's native names (``verl_ds4.models.ds4.hf_checkpoint.save_hf_checkpoint(...,
family="native")``); weights come from it (``engine.use_dist_checkpointing=False``) or from a dist checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

from verl_ds4.substitutes import megatron_dev
from verl_ds4.substitutes.environment import quiet_progress, require_bridge, require_megatron_dev

__all__ = ["NATIVE_MARKERS", "NotNativeFolder", "PRODUCTION_SETTINGS", "VENDOR", "ProductionCPUMegatronEngineWithLMHead",
           "ProductionCPUMegatronEngineWithValueHead", "production_overrides", "register_production_cpu_engines"]

#: ``VERL_ENGINE_VENDOR`` value that selects these engines for ``device="cpu"``.
VENDOR = "production"


def _use_megatron_dev() -> None:
    """Megatron-LM dev first on ``sys.path`` (the default proven commit, or ``MEGATRON_DEV_DIR``) when nothing
    imported megatron yet and no dev tree is on the path; then refuse a released ``megatron.core`` or a Python /
    Megatron-Bridge that cannot build DS4, saying what to do (:mod:`verl_ds4.substitutes.environment`)."""
    if "megatron.core" not in sys.modules and not megatron_dev.roots_on_path():
        megatron_dev.use(megatron_dev.find())
    require_megatron_dev()  # a released megatron.core imported first: import this module first (VERL_USE_EXTERNAL_MODULES)
    require_bridge()


_use_megatron_dev()

from verl_ds4.substitutes.registry import install_all  # noqa: E402

#: What :func:`install_all` did in this process (``SUBSTITUTES.undo()`` restores every original).
SUBSTITUTES = install_all()

from verl.workers.engine.megatron.transformer_impl import (  # noqa: E402
    MegatronEngineWithLMHead,
    MegatronEngineWithValueHead,
)

from verl_ds4.cpu.engine import _CPUMegatronEngineMixin, register_cpu_engines  # noqa: E402
from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead, DS4MegatronEngineWithValueHead  # noqa: E402
from verl_ds4.substitutes.cuda_literals import cuda_literals_on_cpu  # noqa: E402
from verl_ds4.substitutes.provider_settings import CPU_OVERRIDES  # noqa: E402

#: The provider settings this engine adds to ``engine.override_transformer_config`` where the user set none:
#: the CPU settings, and the indexer-loss coefficient (Megatron-LM dev's unfused THD path at CP 1 multiplies by the
#: raw config value, ``None`` raises a TypeError in a training forward; ``None`` means 0 everywhere else in dev).
PRODUCTION_SETTINGS: dict[str, Any] = {**CPU_OVERRIDES, "dsa_indexer_loss_coeff": 0.0}


def production_overrides(user: Mapping[str, Any] | None) -> dict[str, Any]:
    """``user`` (``engine.override_transformer_config``) plus :data:`PRODUCTION_SETTINGS` where unset; raises
    ``ValueError`` naming every key the user set to a value the CPU cannot run."""
    merged = dict(user or {})
    wrong = {k: merged[k] for k, v in PRODUCTION_SETTINGS.items() if k in merged and merged[k] != v}
    if "dsa_indexer_loss_coeff" in wrong and isinstance(wrong["dsa_indexer_loss_coeff"], (int, float)) \
            and not isinstance(wrong["dsa_indexer_loss_coeff"], bool):
        del wrong["dsa_indexer_loss_coeff"]  # any number is a coefficient; only None (or a non-number) is refused
    if wrong:
        fixes = ", ".join(f"{k}={PRODUCTION_SETTINGS[k]!r}" for k in wrong)
        raise ValueError(
            "the production CPU engine cannot run engine.override_transformer_config "
            + ", ".join(f"{k}={v!r}" for k, v in wrong.items())
            + " (the fused kernels, TransformerEngine modules and grouped GEMM are CUDA kernels; a None "
            "dsa_indexer_loss_coeff fails in Megatron-LM dev's training forward). Remove those overrides or set "
            f"{fixes} (dsa_indexer_loss_coeff: any number, 0.0 = no indexer loss).")
    for key, value in PRODUCTION_SETTINGS.items():
        merged.setdefault(key, value)
    return merged


#: Tensors every DeepSeek-V4 folder in DeepSeek's native names has (transformers' names: model.embed_tokens.weight, ...).
NATIVE_MARKERS = ("embed.weight", "head.weight", "norm.weight")


class NotNativeFolder(ValueError):
    """A model folder whose tensors are not in DeepSeek's native names (Megatron-Bridge's DS4 bridge reads only those)."""


def _checked_load(bridge, load):
    """``bridge.load_hf_weights`` that first refuses a folder not in DeepSeek's native names (Bridge 0.6.2 alone ends
    in ``KeyError: 'Key not found: layers.0.hc_ffn_scale'`` for transformers' names)."""

    def load_hf_weights(model, hf_path=None, *args, **kwargs):
        keys = set(bridge.hf_pretrained.state.source.get_all_keys())
        missing = [k for k in NATIVE_MARKERS if k not in keys]
        if missing:
            raise NotNativeFolder(
                f"the model folder {hf_path} has no {missing}: Megatron-Bridge's DeepSeek-V4 bridge reads DeepSeek's "
                f"native names (embed.weight, layers.N.attn.wq_a.weight, head.weight); this folder has e.g. "
                f"{sorted(keys)[:4]}. A folder in transformers' names re-saves in native ones with "
                "verl_ds4.models.ds4.hf_checkpoint (load_hf_checkpoint, then save_hf_checkpoint(model, folder, "
                "family='native')).")
        return load(model, hf_path, *args, **kwargs)

    return load_hf_weights


class _ProductionCPUMixin(_CPUMegatronEngineMixin):
    """The CPU mixin with verl's own ``_build_tf_config`` / ``_build_megatron_module`` (the Bridge branch) back."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        if getattr(engine_config, "vanilla_mbridge", False):
            raise ValueError("the production CPU engine runs verl's Megatron-Bridge branch: set "
                             "engine.vanilla_mbridge=False (mbridge forces TransformerEngine layers, a CUDA library)")
        merged = production_overrides(engine_config.override_transformer_config)
        # a copy: the caller's config object (possibly shared with other engines) is left as it was
        engine_config = dataclasses.replace(engine_config, override_transformer_config=merged)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    ENGINE_NAME = "production CPU Megatron engine"

    def _validate_cpu_engine_config(self) -> None:
        super()._validate_cpu_engine_config()
        self._refuse_unsavable_hf_checkpoint()

    def _checkpoint_setting_problems(self) -> list[str]:
        """HF-format weights are allowed (Megatron-Bridge loads them); dist checkpointing needs its path."""
        ec = self.engine_config
        if ec.use_dist_checkpointing and not ec.dist_checkpointing_path:
            return ["use_dist_checkpointing=True without dist_checkpointing_path (set engine.use_dist_checkpointing=False "
                    "to load the model folder's safetensors through Megatron-Bridge, or give engine.dist_checkpointing_path)"]
        return []

    def _refuse_unsavable_hf_checkpoint(self) -> None:
        """A training engine without dist checkpointing saves its model in HF format through Megatron-Bridge
        (verl's ``should_save_hf_model``), and Bridge 0.6.2's ``save_hf_weights`` imports ModelOpt
        (``auto_bridge.py``: ``from modelopt.torch.quantization.utils import is_quantized``). Refuse at start-up,
        not at the first save after the training ran, when that import fails here."""
        ec, contents = self.engine_config, list(getattr(self.checkpoint_config, "save_contents", None) or ())
        if ec.forward_only or ec.use_dist_checkpointing or not ({"model", "hf_model"} & set(contents)):
            return
        try:
            import modelopt.torch.quantization.utils  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"checkpoint.save_contents={contents} with engine.use_dist_checkpointing=False saves the model in HF "
                f"format through Megatron-Bridge, whose save_hf_weights imports ModelOpt, and that import fails here "
                f"({type(e).__name__}: {e}). Install nvidia-modelopt with what its import needs, or save no model "
                "(checkpoint.save_contents without model/hf_model, e.g. [optimizer,extra]), or start from a dist "
                "checkpoint (engine.use_dist_checkpointing=True engine.dist_checkpointing_path=...).") from e

    def _build_tf_config(self):
        """verl's own (the CPU mixin's replacement skipped)."""
        with cuda_literals_on_cpu():
            return super(_CPUMegatronEngineMixin, self)._build_tf_config()

    def _build_megatron_module(self):
        """verl's own ``make_megatron_module`` + ``bridge.load_hf_weights`` (the CPU mixin's replacement skipped);
        while it runs, the bridge's load first refuses a folder that is not in DeepSeek's native names
        (:func:`_checked_load`)."""
        bridge = self.bridge
        bridge.load_hf_weights = _checked_load(bridge, bridge.load_hf_weights)  # this instance, for this build
        try:
            with cuda_literals_on_cpu(), quiet_progress():
                module = super(_CPUMegatronEngineMixin, self)._build_megatron_module()
        finally:
            del bridge.load_hf_weights  # the class's method again
        for chunk in module:
            for name, param in chunk.named_parameters():
                if param.device.type != "cpu":
                    raise RuntimeError(f"the production CPU engine built {name} on {param.device}; expected the CPU")  # error-catalogue: internal invariant (the substitutes build on the CPU)
        return module


# _CPUMegatronEngineMixin is named again so that it stays before verl's engine in the MRO (C3 would otherwise put
# verl's engine right after _ProductionCPUMixin and the CPU mixin behind it).


class ProductionCPUMegatronEngineWithLMHead(
    DS4MegatronEngineWithLMHead, _ProductionCPUMixin, _CPUMegatronEngineMixin, MegatronEngineWithLMHead
):
    """verl-ds4's LM-head engine (actor, reference, SFT) on the CPU with the production model."""

    accepts_fp32_params = True  # engine.dtype=float32 through CPUMcoreEngineConfig


class ProductionCPUMegatronEngineWithValueHead(
    DS4MegatronEngineWithValueHead, _ProductionCPUMixin, _CPUMegatronEngineMixin, MegatronEngineWithValueHead
):
    """verl-ds4's value-head engine (critic) on the CPU with the production model (verl's value head on the
    Bridge-built model: Bridge's ``make_value_model`` hook)."""

    accepts_fp32_params = True


def register_production_cpu_engines() -> bool:
    """Register the engines with verl's ``EngineRegistry`` for ``device="cpu"``, vendor :data:`VENDOR` (selected by
    ``VERL_ENGINE_VENDOR=production``); the default CPU engines are registered too and stay the default. Idempotent;
    returns True if this call registered them. Another class already under the key is an error."""
    from verl.workers.engine.base import EngineRegistry

    register_cpu_engines()
    done = False
    for model_type, cls in (("language_model", ProductionCPUMegatronEngineWithLMHead),
                            ("value_model", ProductionCPUMegatronEngineWithValueHead)):
        existing = EngineRegistry._engines.get(model_type, {}).get("megatron", {}).get(("cpu", VENDOR))
        if existing is cls:
            continue
        if existing is not None:
            raise RuntimeError(f"EngineRegistry already maps ({model_type!r}, 'megatron', ('cpu', {VENDOR!r})) to "
                               f"{existing.__module__}.{existing.__qualname__}; refusing to replace it")
        EngineRegistry.register(model_type=model_type, backend="megatron", device="cpu", vendor=VENDOR)(cls)
        done = True
    return done


if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    register_production_cpu_engines()
