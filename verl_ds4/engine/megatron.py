"""verl-ds4's Megatron engines: verl 0.9.1's engines with one resolved CP layout for every data path.

:class:`DS4MegatronEngineWithLMHead` and :class:`DS4MegatronEngineWithValueHead` subclass verl's
``MegatronEngineWithLMHead`` / ``MegatronEngineWithValueHead`` and are registered under
``strategy=megatron`` by :mod:`verl_ds4.engine.plugin`. They differ from verl's in three ways:

1. Before the model is built, :func:`verl_ds4.mcore.resolver.transformer_config_fills` fills the
   missing ``cp_partition_mode`` / ``sequence_packing_scheduler`` and rejects settings DS4 cannot
   run with; a user's explicit value is kept (verl 0.9.1 overwrites it for ``deepseek_v4``).
2. After the model is built, :func:`verl_ds4.mcore.resolver.resolve_cp_layout` decides the layout
   and padding once; the :class:`~verl_ds4.mcore.resolver.ResolvedCPLayout` is exposed as
   ``engine.resolved_cp_layout``, passed to the forward functions, and registered for the model
   chunks and the ``TransformerConfig`` (:func:`verl_ds4.mcore.resolver.register_layout`, a registry
   of weak references: nothing is set on Megatron's objects).
3. While the engine runs ``forward_backward_batch`` the resolved object is *active*
   (:func:`active_layout`), and verl's own copies of the layout rule read it instead of deciding
   again (:func:`install_verl_hooks`):

   ==================================================================  ==========================================
   verl 0.9.1 call site (looked up at call time)                       what answers while an engine is active
   ==================================================================  ==========================================
   ``MegatronEngine._get_context_parallel_layout`` (method)            overridden: ``resolved.layout``
   ``verl.models.mcore.get_mcore_engine_forward_fn``                   our :mod:`verl_ds4.mcore.model_forward`
   ``verl.models.mcore.get_mcore_forward_fused_model_engine_fn``       our :mod:`verl_ds4.mcore.model_forward_fused`
   ``router_replay_utils._context_parallel_layout``                    ``resolved.layout``
   ``router_replay_utils.preprocess_thd_engine`` / ``postprocess_...``  our packing with the resolved options
   ``transformer_impl.DynamicCPScheduler`` (the DCP block)             scheduler fed the resolved layout / rows
   ``verl.utils.megatron_utils.mapping_string_to_attn_backend``        guards the resolver-owned override keys
   ``CheckpointHandler.save_checkpoint`` (SFT, method on verl's class)  tracker after the manifest (:mod:`.checkpoint`)
   ==================================================================  ==========================================

   Outside an active engine every hook calls verl's original, so verl's stock engines in the same
   process behave exactly as before. :data:`VERL_HOOKS` lists the call sites; the originals are
   kept while installed, and :func:`uninstall_verl_hooks` puts them back exactly.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import Any

import verl.models.mcore as _verl_mcore
import verl.utils.megatron.router_replay_utils as _router_replay_utils
import verl.utils.megatron_utils as _verl_megatron_utils
import verl.workers.engine.megatron.transformer_impl as _transformer_impl
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

from verl_ds4.engine.checkpoint import ManifestCheckpointEngine, handler_save_checkpoint
from verl_ds4.engine import dev_corrections, sparse_attention, straggler
from verl_ds4.engine.verl_hook import Installed as _Installed
from verl_ds4.engine.verl_hook import VerlHook
from verl_ds4.engine.micro_batches import SeedingIterator as _SeedingIterator
from verl_ds4.engine.config import cp_balance_cost_model, cp_balance_of
from verl_ds4.mcore import batch_plans, indexer_replay, resolver
from verl_ds4.mcore.resolver import CPLayoutError, ResolvedCPLayout

logger = logging.getLogger(__name__)

__all__ = [
    "DS4MegatronEngineWithLMHead",
    "DS4MegatronEngineWithValueHead",
    "active_layout",
    "current_layout",
    "hooks_installed",
    "install_verl_hooks",
    "uninstall_verl_hooks",
]

_ACTIVE: contextvars.ContextVar[ResolvedCPLayout | None] = contextvars.ContextVar(
    "verl_ds4_active_cp_layout", default=None
)
_OWNED_OVERRIDES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "verl_ds4_owned_overrides", default=None
)
_ABSENT = object()


@contextlib.contextmanager
def active_layout(resolved: ResolvedCPLayout):
    """Make ``resolved`` the layout verl's hooked call sites read, for the duration of the block."""
    if not isinstance(resolved, ResolvedCPLayout):
        raise TypeError(f"expected a ResolvedCPLayout, got {type(resolved).__name__}")
    token = _ACTIVE.set(resolved)
    try:
        yield resolved
    finally:
        _ACTIVE.reset(token)


def current_layout() -> ResolvedCPLayout | None:
    """The layout of the engine running now in this context (``None`` outside our engines)."""
    return _ACTIVE.get()


# ----------------------------------------------------------------------------------------------
# Override guard: keeps the resolver's (and the user's) cp_partition_mode / scheduler
# ----------------------------------------------------------------------------------------------


class _GuardedOverrides(dict):
    """``override_transformer_config`` whose resolver-owned keys later code cannot replace.

    verl 0.9.1's ``_build_tf_config`` calls ``.update({...})`` on this dict for ``deepseek_v4`` after
    the user's overrides were read; the guard keeps the owned values (the user's, or the
    resolver's fill) and drops the attempted replacement, logging what it kept.
    """

    def __init__(self, data: Mapping, owned: Mapping[str, Any]):
        super().__init__(data)
        self._owned = dict(owned)
        for key, value in self._owned.items():
            if value is _ABSENT:
                super().pop(key, None)
            else:
                super().__setitem__(key, value)

    def _filter(self, items: Mapping) -> dict:
        kept = {}
        for key, value in items.items():
            if key in self._owned:
                current = self._owned[key]
                if current is _ABSENT or current != value:
                    logger.info(
                        "verl-ds4: kept override_transformer_config.%s=%s; a later default tried to set %r",
                        key,
                        "<unset>" if current is _ABSENT else repr(current),
                        value,
                    )
                continue
            kept[key] = value
        return kept

    def update(self, other=(), /, **kwargs):
        merged = dict(other, **kwargs)
        super().update(self._filter(merged))

    def __setitem__(self, key, value):
        kept = self._filter({key: value})
        if kept:
            super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self and key not in self._owned:
            super().__setitem__(key, default)
        return self.get(key)


def _guarded_mapping_string_to_attn_backend(original):
    @functools.wraps(original)
    def wrapper(args: dict) -> dict:
        result = original(args)
        owned = _OWNED_OVERRIDES.get()
        if owned is None:
            return result
        return _GuardedOverrides(result, owned)

    wrapper.__verl_ds4_hook__ = True
    return wrapper


# ----------------------------------------------------------------------------------------------
# Hooks on verl's module-level call sites
# ----------------------------------------------------------------------------------------------


def _forward_fn_getter(original, kind: str):
    @functools.wraps(original)
    def getter(hf_config):
        resolved = current_layout()
        if resolved is None:
            return original(hf_config)
        if kind == "fused":
            from verl_ds4.mcore.model_forward_fused import fused_forward_model_engine

            vision = _is_vision_config(hf_config)
            return functools.partial(fused_forward_model_engine(vision), resolved=resolved)
        from verl_ds4.mcore.model_forward import gptmodel_forward_model_engine

        return functools.partial(gptmodel_forward_model_engine, resolved=resolved)

    getter.__verl_ds4_hook__ = True
    return getter


def _is_vision_config(hf_config) -> bool:
    from verl.models.mcore.registry import supported_vlm

    architectures = getattr(hf_config, "architectures", None) or [None]
    return architectures[0] in supported_vlm


def _router_layout_rule(original):
    @functools.wraps(original)
    def rule(tf_config) -> str:
        resolved = current_layout() or resolver.layout_of(tf_config)
        return original(tf_config) if resolved is None else resolved.layout

    rule.__verl_ds4_hook__ = True
    return rule


def _router_pack(original):
    """``preprocess_thd_engine`` as router replay calls it, packing with the resolved options."""

    @functools.wraps(original)
    def pack(tensor, pre_process=True, need_roll=False, use_fp8_padding=False, local_cp_size=None, **kwargs):
        resolved = current_layout()
        if resolved is None:
            return original(
                tensor,
                pre_process=pre_process,
                need_roll=need_roll,
                use_fp8_padding=use_fp8_padding,
                local_cp_size=local_cp_size,
                **kwargs,
            )
        from verl_ds4.mcore.model_forward import pack_thd

        return pack_thd(tensor, resolved, pre_process=pre_process, need_roll=need_roll, local_cp_size=local_cp_size)

    pack.__verl_ds4_hook__ = True
    return pack


def _router_unpack(original):
    @functools.wraps(original)
    def unpack(output, packed_seq_params, input_ids, batch_size, post_process=True, local_cp_size=None, **kwargs):
        resolved = current_layout()
        if resolved is None:
            return original(
                output,
                packed_seq_params,
                input_ids,
                batch_size,
                post_process=post_process,
                local_cp_size=local_cp_size,
                **kwargs,
            )
        from verl_ds4.mcore.model_forward import unpack_thd

        return unpack_thd(
            output, packed_seq_params, input_ids, resolved, post_process=post_process, local_cp_size=local_cp_size
        )

    unpack.__verl_ds4_hook__ = True
    return unpack


class ResolvedDynamicCPScheduler(_transformer_impl.DynamicCPScheduler):
    """verl's dynamic-CP scheduler fed the resolved layout and minimum rows.

    verl 0.9.1 (transformer_impl.py:882) re-derives the layout from the attention variant and gives
    the minimum rows only to the fused path; here both come from the active resolved object, and the
    router padding mask of every micro-batch is rebuilt with the same packing as the tokens.
    """

    def schedule(self, batch, dcp_group, *, tp_size: int, cp_layout: str = "zigzag", min_local_rows=None):
        resolved = current_layout()
        if resolved is None:
            return super().schedule(
                batch, dcp_group, tp_size=tp_size, cp_layout=cp_layout, min_local_rows=min_local_rows
            )
        if tp_size != resolved.tp_size:
            raise CPLayoutError(f"dynamic CP scheduled with tp_size={tp_size}, but the engine resolved {resolved.tp_size}")
        micro_batches = super().schedule(
            batch, dcp_group, tp_size=tp_size, cp_layout=resolved.layout, min_local_rows=resolved.min_local_rows
        )
        from verl_ds4.mcore.model_forward import refresh_dynamic_cp_padding

        for micro_batch in micro_batches:
            refresh_dynamic_cp_padding(micro_batch, resolved, dcp_group)
        return micro_batches


#: Every verl call site :func:`install_verl_hooks` replaces (the table in the module docstring).
VERL_HOOKS: tuple[VerlHook, ...] = (
    VerlHook(
        "verl.models.mcore.get_mcore_engine_forward_fn",
        _verl_mcore,
        "get_mcore_engine_forward_fn",
        lambda f: _forward_fn_getter(f, "plain"),
    ),
    VerlHook(
        "verl.models.mcore.get_mcore_forward_fused_model_engine_fn",
        _verl_mcore,
        "get_mcore_forward_fused_model_engine_fn",
        lambda f: _forward_fn_getter(f, "fused"),
    ),
    VerlHook(
        "router_replay_utils._context_parallel_layout", _router_replay_utils, "_context_parallel_layout", _router_layout_rule
    ),
    VerlHook("router_replay_utils.preprocess_thd_engine", _router_replay_utils, "preprocess_thd_engine", _router_pack),
    VerlHook("router_replay_utils.postprocess_thd_engine", _router_replay_utils, "postprocess_thd_engine", _router_unpack),
    VerlHook(
        "transformer_impl.DynamicCPScheduler",
        _transformer_impl,
        "DynamicCPScheduler",
        lambda _cls: ResolvedDynamicCPScheduler,
    ),
    VerlHook(
        "megatron_utils.mapping_string_to_attn_backend",
        _verl_megatron_utils,
        "mapping_string_to_attn_backend",
        _guarded_mapping_string_to_attn_backend,
    ),
    VerlHook(
        "CheckpointHandler.save_checkpoint",
        "verl.utils.checkpoint.checkpoint_handler:CheckpointHandler",
        "save_checkpoint",
        handler_save_checkpoint,
    ),
)


#: While the hooks are installed: hook label -> verl's original and our replacement.
_INSTALLED: dict[str, _Installed] = {}


def install_verl_hooks(defer_unresolved: bool = False) -> None:
    """Route verl 0.9.1's copies of the layout rule through the active resolved layout.

    Idempotent; :func:`uninstall_verl_hooks` puts verl's originals back (and a later install
    replaces them again). ``defer_unresolved`` (the plugin, while verl itself is still importing): a hook
    whose verl module is not initialised yet is left for the next call (every engine's construction makes
    one, and raises if it still cannot be resolved then).
    """
    if len(_INSTALLED) == len(VERL_HOOKS):
        return
    for hook in VERL_HOOKS:
        if hook.label in _INSTALLED:
            continue
        try:
            target = hook.target
            current = getattr(target, hook.name)
        except (AttributeError, ImportError):
            if defer_unresolved and isinstance(hook.module, str):
                continue
            raise
        if getattr(current, "__verl_ds4_hook__", False) or current is ResolvedDynamicCPScheduler:
            raise RuntimeError(
                f"verl's {hook.label} is already a verl-ds4 hook that this registry did not install (was "
                "verl_ds4.engine.megatron imported twice?); verl's original cannot be recovered. Restart the process."
            )
        replacement = hook.make(current)
        setattr(target, hook.name, replacement)
        _INSTALLED[hook.label] = _Installed(current, replacement)


def uninstall_verl_hooks() -> None:
    """Put verl's original objects back on every hooked call site (idempotent).

    Raises if someone replaced one of our hooks in the meantime (restoring verl's object would
    silently drop their replacement); the other call sites are restored first.
    """
    replaced_by_others = []
    for hook in VERL_HOOKS:
        installed = _INSTALLED.get(hook.label)
        if installed is None:
            continue
        if getattr(hook.target, hook.name) is not installed.replacement:
            replaced_by_others.append(hook.label)
            continue
        setattr(hook.target, hook.name, installed.original)
        del _INSTALLED[hook.label]
    if replaced_by_others:
        raise RuntimeError(
            f"cannot uninstall verl-ds4's hooks on {replaced_by_others}: something else replaced them after "
            "install_verl_hooks(). Undo that replacement first (e.g. end its monkeypatch), then uninstall."
        )


def verl_originals() -> dict[str, Any]:
    """verl's original object of each hooked call site that is hooked now (for tests and doctor)."""
    return {label: installed.original for label, installed in _INSTALLED.items()}


def hooks_installed() -> dict[str, bool]:
    """Which verl call sites currently answer through verl-ds4 (for ``verl-ds4 doctor`` and tests)."""
    result = {}
    for hook in VERL_HOOKS:
        installed = _INSTALLED.get(hook.label)
        result[hook.label] = installed is not None and getattr(hook.target, hook.name) is installed.replacement
    return result


# ----------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------


def _indexer_replay_on(engine_config) -> bool:
    return bool(getattr(engine_config, "indexer_replay", False))


def _unwrap_model(chunk):
    from verl.utils.megatron_utils import unwrap_model

    return unwrap_model(chunk)


def _pad_to_length_bucket(engine_config) -> int | None:
    if getattr(engine_config, "pad_to_length", False) and getattr(engine_config, "use_remove_padding", False):
        return engine_config.pad_to_length_bucket
    return None


def _hf_config_of(engine) -> Any:
    """The engine's HF config (``None`` for an engine built without a model config, e.g. in tests)."""
    return getattr(getattr(engine, "model_config", None), "hf_config", None)


def _user_overrides(engine_config) -> dict[str, Any]:
    return dict(getattr(engine_config, "override_transformer_config", None) or {})


class _ResolvedLayoutEngine:
    """Mixin over verl's Megatron engine: resolve the CP layout once and make every path use it."""

    #: The engine's CP layout, set once the model is built (``None`` before).
    resolved_cp_layout: ResolvedCPLayout | None = None
    #: Whether fp32 parameters are supported (only the CPU engines, see ``CPUMcoreEngineConfig``).
    accepts_fp32_params: bool = False
    #: Where ``sparse_attention=linear`` goes: into Megatron-LM dev's DS4 layers (GPU engines: the csa module's
    #: functions are replaced at start-up) or into the model's own attention modules (CPU engines: their
    #: ``sparse_core`` is set once the model is built).
    sparse_attention_in_megatron: bool = True

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        install_verl_hooks()
        self._check_startup_settings(model_config, engine_config)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    # -- start-up checks -----------------------------------------------------------------------

    def _check_startup_settings(self, model_config, engine_config) -> None:
        """Reject settings that cannot work before verl initialises parallel state."""
        if str(getattr(engine_config, "dtype", "")) in ("float32", "fp32") and not self.accepts_fp32_params:
            raise ValueError(
                f"engine.dtype={engine_config.dtype} is supported by verl-ds4's CPU engines only; "
                "on GPUs use engine.dtype=bfloat16 (Megatron keeps fp32 main parameters in the optimizer)."
            )
        cp_balance_of(engine_config)  # a bad value fails here, not at the first micro-batch
        self._prepare_sparse_attention(engine_config)
        dev_corrections.install(model_config.hf_config, engine_config.context_parallel_size, self.sparse_attention_in_megatron)
        bucket = _pad_to_length_bucket(engine_config)
        if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
            raise CPLayoutError(f"engine pad_to_length_bucket must be a positive int, got {bucket!r}")
        # DS4 + TP>1, DS4 + explicit zigzag, unsupported scheduler: raised here, before any model is built.
        self._config_fills = resolver.transformer_config_fills(
            model_config.hf_config,
            user_overrides=_user_overrides(engine_config),
            cp_size=engine_config.context_parallel_size,
            tp_size=engine_config.tensor_model_parallel_size,
            dynamic_cp=bool(getattr(engine_config, "dynamic_context_parallel", False)),
        )

    def _prepare_sparse_attention(self, engine_config) -> None:
        """``sparse_attention=linear`` before the model is built (:func:`verl_ds4.engine.sparse_attention.prepare`)."""
        sparse_attention.prepare(engine_config, self.sparse_attention_in_megatron)

    def _use_sparse_core(self, module) -> None:
        """CPU engines: the built model's attention takes the core (:func:`verl_ds4.engine.sparse_attention.use_in_model`)."""
        sparse_attention.use_in_model(self.engine_config, module, self.sparse_attention_in_megatron, _unwrap_model)

    # -- building ------------------------------------------------------------------------------

    def _build_tf_config(self):
        user = _user_overrides(self.engine_config)
        fills = getattr(self, "_config_fills", None)
        if fills is None:
            fills = resolver.transformer_config_fills(
                self.model_config.hf_config,
                user_overrides=user,
                cp_size=self.engine_config.context_parallel_size,
                tp_size=self.engine_config.tensor_model_parallel_size,
                dynamic_cp=bool(self.engine_config.dynamic_context_parallel),
            )
        owned = None
        if resolver.is_ds4_hf_config(self.model_config.hf_config) or any(
            key in user for key in resolver.OWNED_OVERRIDE_KEYS
        ):
            owned = {key: user.get(key, fills.get(key, _ABSENT)) for key in resolver.OWNED_OVERRIDE_KEYS}
        token = _OWNED_OVERRIDES.set(owned)
        try:
            return super()._build_tf_config()
        finally:
            _OWNED_OVERRIDES.reset(token)

    def _build_megatron_module(self):
        module = super()._build_megatron_module()
        self._resolve_cp_layout(module)
        return module

    def initialize(self):
        super().initialize()
        if self.resolved_cp_layout is None:  # a subclass built the module without our _build_megatron_module
            self._resolve_cp_layout(self.module)

    def _resolve_cp_layout(self, module) -> ResolvedCPLayout:
        engine_config = self.engine_config
        resolved = resolver.resolve_cp_layout(
            module,
            self.tf_config,
            cp_size=engine_config.context_parallel_size,
            tp_size=engine_config.tensor_model_parallel_size,
            dynamic_cp=bool(getattr(engine_config, "dynamic_context_parallel", False)),
            pad_to_length_bucket=_pad_to_length_bucket(engine_config),
            user_overrides=_user_overrides(engine_config),
            # cp_balance=ds4 is balanced with this model's own DS4 shape (Pro's layers for Pro)
            balance=cp_balance_cost_model(cp_balance_of(engine_config), _hf_config_of(self)),
        )
        if dev_corrections.real_cu_seqlens(_hf_config_of(self), self.sparse_attention_in_megatron):
            resolved = dataclasses.replace(resolved, real_cu_seqlens=True)
        resolver.register_layout(module, resolved, self.tf_config)
        self.resolved_cp_layout = resolved
        self._use_sparse_core(module)
        if _indexer_replay_on(engine_config):  # refuses a model without an indexer here, at start-up
            for chunk in module if isinstance(module, (list, tuple)) else [module]:
                indexer_replay.enable(_unwrap_model(chunk))
        logger.info("verl-ds4 %s: %s", type(self).__name__, resolved.describe())
        return resolved

    def _require_layout(self) -> ResolvedCPLayout:
        if self.resolved_cp_layout is None:
            raise RuntimeError(
                f"{type(self).__name__} has no resolved CP layout: call initialize() before running batches."
            )
        return self.resolved_cp_layout

    # -- running -------------------------------------------------------------------------------

    def _get_context_parallel_layout(self, unwrapped_model) -> str:  # verl: a staticmethod with the rule
        return self._require_layout().layout

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        resolved = self._require_layout()
        with active_layout(resolved), straggler.step_scope(resolved.balance, _hf_config_of(self)) as step:
            output = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        straggler.report(output, step, data, forward_only, self.get_data_parallel_size())  # perf/*_straggler_ratio
        return output

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        # One plan per micro-batch: router replay, the forward and the unpacking share it; a
        # dynamic-CP micro-batch brings the plan its scheduler built.
        replay = _indexer_replay_on(self.engine_config)
        scope = indexer_replay.micro_batch_scope() if replay else contextlib.nullcontext()
        with active_layout(self._require_layout()), batch_plans.micro_batch_plans(), scope:
            batches = _SeedingIterator(batch_iter, replay)
            result = super().forward_step(batches, model, logits_processor_func, postprocess_micro_batch_func)
            straggler.record(batches.last, batch_plans.scope_plans())
            return result


class DS4MegatronEngineWithLMHead(ManifestCheckpointEngine, _ResolvedLayoutEngine, MegatronEngineWithLMHead):
    """verl's Megatron LM-head engine (actor, reference, SFT) with one resolved CP layout."""


class DS4MegatronEngineWithValueHead(ManifestCheckpointEngine, _ResolvedLayoutEngine, MegatronEngineWithValueHead):
    """verl's Megatron value-head engine (critic) with one resolved CP layout.

    Dynamic CP is not supported for value models (verl 0.9.1 has no value path through its dynamic
    CP scheduler); it is rejected at start-up.
    """

    def _check_startup_settings(self, model_config, engine_config) -> None:
        if _indexer_replay_on(engine_config):
            indexer_replay.refuse_critic()
        if getattr(engine_config, "dynamic_context_parallel", False):
            raise CPLayoutError(
                "dynamic_context_parallel=True is not supported for value models (the critic): verl 0.9.1 has no "
                "value-head path through the dynamic-CP scheduler. Set dynamic_context_parallel=False for the "
                "critic (e.g. critic.megatron.dynamic_context_parallel=False) and use a static "
                "context_parallel_size instead."
            )
        super()._check_startup_settings(model_config, engine_config)


def _complete_registration_started_by_the_plugin() -> None:
    # When this module is what imported verl's engine module, the plugin's after-import hook ran
    # while this module was half-initialised; it finishes the registration now.
    import sys

    plugin = sys.modules.get("verl_ds4.engine.plugin")
    if plugin is not None:
        plugin.complete_pending_registration()


_complete_registration_started_by_the_plugin()
