"""The one place that decides the context-parallel (CP) layout of a model.

Every data path of the engine (LM head fused and non-fused, value head, reference model,
MTP inputs, router replay, dynamic CP) packs its per-token tensors with the object this module
returns, so rows can never disagree between paths. No other module of ``verl_ds4`` may decide a
layout from a model name or config (``tests/test_layout_resolver_on_cpu.py`` parses the package
and fails otherwise).

Two decisions, both made once per engine and never per forward:

* :func:`transformer_config_fills`, before the model is built: which values of
  ``cp_partition_mode`` / ``sequence_packing_scheduler`` to fill into the user's
  ``override_transformer_config``. A user's explicit value is kept (and rejected with an error
  when it cannot work); only missing values are filled in.
* :func:`resolve_cp_layout`, after the model is built: the layout and padding every path uses,
  read from the model's own config and attention modules, returned as a frozen
  :class:`ResolvedCPLayout`.

Who consumes which layout
-------------------------
Each attention module says it (:mod:`verl_ds4.mcore.requirements`, the CP partition-mode protocol:
``required_cp_partition_mode``, ``min_local_rows``, optionally ``accepted_cp_partition_modes``), or
is listed in the one table of modules known without a declaration,
:data:`~verl_ds4.mcore.requirements.KNOWN_CP_PARTITION_MODES` (Megatron-Core's and
TransformerEngine's ``DotProductAttention``: ``zigzag``). On top of that:

* ``TransformerConfig.dsv4_version == "v4.1"`` (DeepSeek-V4.1 on Megatron-LM dev, beside
  ``experimental_attention_variant == "dsv4_hybrid"``): ``contiguous`` with at least
  ``max(csa_window_size, largest csa_compress_ratios entry, Engram lookback)`` rows per CP rank
  (``engram_max_ngram_size - 1`` when ``engram_layer_ids`` is set; the same rule as
  ``DS41TransformerConfig.min_local_rows``, which a config that has it supplies itself). Every attention
  module must be one the resolver knows (dev's ``CompressedSparseAttention2``, a declaring module): an
  unknown one under CP is refused, never guessed.
* ``TransformerConfig.experimental_attention_variant == "dsv4_hybrid"`` (DeepSeek-V4):
  ``contiguous`` with at least D_window rows per CP rank, TP = 1. When the model's attention
  modules declare the protocol (the project's pure-PyTorch DS4 attention) they must agree, and they
  read the split from the rows, on any Megatron-Core. When none declares, the attention is
  Megatron-LM dev's, which must be told through ``PackedSeqParams.cp_partition_mode``.
* ``cp_partition_mode`` on the config, where the installed Megatron-Core has that field, and the
  user's explicit ``override_transformer_config.cp_partition_mode``: honoured if the attention
  modules can consume it, an error otherwise.

Under CP > 1 (or dynamic CP) nothing is assumed: an attention module that declares nothing and is
not in the table, a model without any attention module, and modules whose requirements conflict
are start-up errors naming the modules. At CP = 1 nothing is split, so nothing is required.

Who holds the result
--------------------
The engine keeps its :class:`ResolvedCPLayout` (``engine.resolved_cp_layout``) and passes it to the
forward functions (``resolved=``). :func:`register_layout` also records it in a module-level
registry of weak references, keyed by object identity (model chunks at every wrapper level, and
the ``TransformerConfig``), so :func:`layout_of` / :func:`resolved_for` find it for callers that
only hold the model; nothing is set on Megatron's or verl's objects.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_ds4 import ds4_facts, ds41_facts
from verl_ds4.mcore import megatron_api, requirements
from verl_ds4.mcore.registry import IdentityRegistry

if TYPE_CHECKING:
    from verl_ds4.layout.cost import TokenCostModel
from verl_ds4.mcore.requirements import (
    CONTIGUOUS,
    KNOWN_CP_PARTITION_MODES,
    LAYOUTS,
    ZIGZAG,
    CPLayoutError,
    LayoutRequirement,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CONTIGUOUS",
    "KNOWN_CP_PARTITION_MODES",
    "LAYOUTS",
    "ZIGZAG",
    "CPLayoutError",
    "LayoutRequirement",
    "ResolvedCPLayout",
    "collect_requirements",
    "layout_of",
    "register_layout",
    "resolve_cp_layout",
    "resolved_for",
    "transformer_config_fills",
]

# The keys of ``override_transformer_config`` whose values the resolver owns.
CP_PARTITION_MODE = "cp_partition_mode"
SEQUENCE_PACKING_SCHEDULER = "sequence_packing_scheduler"
OWNED_OVERRIDE_KEYS = (CP_PARTITION_MODE, SEQUENCE_PACKING_SCHEDULER)


@dataclass(frozen=True)
class ResolvedCPLayout:
    """The CP layout and padding of one engine, decided once at start-up.

    Attributes:
        layout: ``"contiguous"`` or ``"zigzag"``: how the global packed buffer is split across CP ranks.
        min_local_rows: fewest rows each CP rank holds (``None``: no minimum); the packed buffer is
            padded to at least ``cp * min_local_rows`` rows, on every path.
        cp_size: the static CP size (dynamic CP uses the per-micro-batch ``local_cp_size`` instead).
        tp_size: tensor-parallel size (rows per rank must divide by it under sequence parallelism).
        pad_to_length_bucket: the total row count is rounded up to a multiple of this (``None``: off).
        fp8_padding: pad for FP8 block quantisation (``config.fp8`` in ``e4m3`` / ``hybrid``).
        dynamic_cp: whether micro-batches carry their own ``local_cp_size`` (dynamic CP).
        sources: who decided the layout, for logs and ``verl-ds4 doctor``.
        balance: contiguous layout only: the cost model whose straggler the order of sequences in
            the packed buffer minimises (``None``: batch order); see ``PlanOptions.balance``.
        real_cu_seqlens: ``cu_seqlens_q`` / ``_kv`` hold the real lengths (verl: the padded ones); set by the DS4
            engines for Megatron-LM dev's DS4 (:func:`verl_ds4.mcore.thd.packed_seq_params_for`).
    """

    layout: str
    min_local_rows: int | None
    cp_size: int
    tp_size: int
    pad_to_length_bucket: int | None = None
    fp8_padding: bool = False
    dynamic_cp: bool = False
    sources: tuple[str, ...] = ()
    balance: "str | TokenCostModel | None" = None
    real_cu_seqlens: bool = False

    @property
    def balance_name(self) -> str | None:
        """The cost model's name (``"ds4"``, ``"dense"``) or ``None``."""
        return getattr(self.balance, "name", self.balance)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise CPLayoutError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")  # error-catalogue: internal: ResolvedCPLayout built with a bad layout by code, not by a user
        if self.balance is not None and self.layout != CONTIGUOUS:
            raise CPLayoutError(
                f"cp_balance={self.balance_name!r} reorders the sequences of the contiguous CP layout, but this engine's "
                f"layout is {self.layout!r}. Set cp_balance=null (recipe knob ds4.cp_balance), or use an attention "
                "that consumes the contiguous layout."
            )
        for name in ("cp_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CPLayoutError(f"{name} must be a positive int, got {value!r}")  # error-catalogue: internal: a caller passed a bad argument
        for name in ("min_local_rows", "pad_to_length_bucket"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise CPLayoutError(f"{name} must be None or a positive int, got {value!r}")  # error-catalogue: internal: a caller passed a bad argument

    def effective_cp_size(self, local_cp_size: int | None = None) -> int:
        """CP size of one micro-batch: ``local_cp_size`` under dynamic CP, else the static size."""
        if local_cp_size is None:
            return self.cp_size
        if not self.dynamic_cp:
            raise CPLayoutError(
                f"a micro-batch carries local_cp_size={local_cp_size}, but this engine was resolved without "
                "dynamic CP; enable dynamic_context_parallel on the engine or drop local_cp_size."
            )
        return int(local_cp_size)

    def plan_options(self, local_cp_size: int | None = None):
        """The layout core's :class:`~verl_ds4.layout.PlanOptions` for one micro-batch."""
        from verl_ds4.layout import PlanOptions

        return PlanOptions(
            layout=self.layout,
            tp_size=self.tp_size,
            cp_size=self.effective_cp_size(local_cp_size),
            min_local_rows=self.min_local_rows,
            pad_to_length_bucket=self.pad_to_length_bucket,
            fp8_padding=self.fp8_padding,
            balance=self.balance,
        )

    def thd_kwargs(self, local_cp_size: int | None = None) -> dict[str, Any]:
        """Keyword arguments of verl 0.9.1's ``preprocess_thd_engine`` signature for this layout."""
        if local_cp_size is not None:
            self.effective_cp_size(local_cp_size)  # validates
        return {
            "cp_layout": self.layout,
            "min_local_rows": self.min_local_rows,
            "pad_to_length_bucket": self.pad_to_length_bucket,
            "use_fp8_padding": self.fp8_padding,
            "local_cp_size": local_cp_size,
        }

    def describe(self) -> str:
        rows = f", >= {self.min_local_rows} rows per CP rank" if self.min_local_rows else ""
        bucket = f", total rows a multiple of {self.pad_to_length_bucket}" if self.pad_to_length_bucket else ""
        cp = "dynamic" if self.dynamic_cp else str(self.cp_size)
        decided = "; ".join(self.sources) or "default"
        balance = f", sequence order balanced under the {self.balance_name} cost model" if self.balance else ""
        return f"{self.layout} CP layout (cp={cp}, tp={self.tp_size}{rows}{bucket}{balance}) decided by: {decided}"


# --------------------------------------------------------------------------------------------
# Facts about the installed Megatron-Core
# --------------------------------------------------------------------------------------------


def packed_seq_params_has_cp_partition_mode() -> bool:
    """Whether the installed ``PackedSeqParams`` can tell Megatron's attention the CP layout."""
    from verl_ds4.mcore import thd

    return thd.packed_seq_params_has_cp_partition_mode()


def transformer_config_fields() -> frozenset[str]:
    """Field names of the installed Megatron-Core ``TransformerConfig``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


# --------------------------------------------------------------------------------------------
# Reading requirements
# --------------------------------------------------------------------------------------------


def _is_ds4_config(tf_config) -> bool:
    return getattr(tf_config, "experimental_attention_variant", None) == ds4_facts.ATTENTION_VARIANT


def _ds4_window(tf_config) -> int:
    """Rows every CP rank needs for DS4: :func:`verl_ds4.ds4_facts.min_local_rows` over the layers."""
    ratios = getattr(tf_config, "csa_compress_ratios", None) or (ds4_facts.WINDOW_ONLY,)
    return ds4_facts.min_local_rows(ds4_facts.window_size(tf_config), ratios)


def ds4_config_min_local_rows(tf_config) -> int | None:
    """Rows every CP rank needs for a Megatron-LM dev DS4 ``TransformerConfig`` (``dsv4_hybrid``); None for another
    model. Dev's DS4 attention declares no ``min_local_rows`` itself: this is the rule its boundary exchange enforces."""
    return _ds4_window(tf_config) if _is_ds4_config(tf_config) else None


def is_ds4_hf_config(hf_config) -> bool:
    """Whether a Hugging Face config describes a model Megatron-Bridge builds with DS4 attention."""
    return getattr(hf_config, "model_type", None) == ds4_facts.HF_MODEL_TYPE


def is_ds41_hf_config(hf_config) -> bool:
    """Whether a Hugging Face config describes DeepSeek-V4.1 (CSA2 and Engram: the same CP rules as DS4)."""
    return getattr(hf_config, "model_type", None) in (ds41_facts.HF_MODEL_TYPE, ds41_facts.HF_TEXT_MODEL_TYPE)


#: How the CP rules name each family's attention in their messages.
V4_ATTENTION = "DeepSeek-V4 attention"
V41_ATTENTION = "DeepSeek-V4.1 attention (CSA2) and Engram"


def _chunks(model) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    return list(model)


@dataclass(frozen=True)
class _Consumers:
    """Everything that consumes the packed rows of a model, and the attention nobody can speak for."""

    requirements: list[LayoutRequirement]
    undeclared: list[str]


def _consumers(chunks: list[torch.nn.Module], tf_config) -> _Consumers:
    scan = requirements.scan_attention_modules(chunks)
    if tf_config is not None and requirements.is_ds41_config(tf_config):
        # V4.1 (Megatron-LM dev or this project's model): every attention module must be known or declare;
        # the config adds the rows rule. dev's CSA2 is in KNOWN_CP_PARTITION_MODES (contiguous).
        v41 = requirements.ds41_config_requirement(
            tf_config, V41_ATTENTION, self_describing=bool(scan.declared) and not scan.known
        )
        return _Consumers([v41, *scan.declared, *scan.known], scan.undeclared)
    if tf_config is None or not _is_ds4_config(tf_config):
        return _Consumers([*scan.declared, *scan.known], scan.undeclared)
    ds4 = LayoutRequirement(
        CONTIGUOUS,
        _ds4_window(tf_config),
        f"TransformerConfig.experimental_attention_variant={ds4_facts.ATTENTION_VARIANT!r}",
        frozenset([CONTIGUOUS]),
        # Declaring modules (e.g. the pure-PyTorch DS4 attention) read the split from the rows;
        # without them the attention is Megatron-LM dev's, told through PackedSeqParams.
        self_describing=bool(scan.declared),
    )
    if not scan.declared:
        # Megatron-LM dev's DS4 attention owns the attention path; Megatron / TE modules inside it
        # are not separate consumers.
        return _Consumers([ds4], [])
    return _Consumers([ds4, *scan.declared, *scan.known], scan.undeclared)


def collect_requirements(model, tf_config=None) -> list[LayoutRequirement]:
    """Every layout requirement in ``model`` (a module or a list of pipeline chunks).

    Declaring modules are reported one by one; modules of ``KNOWN_CP_PARTITION_MODES`` once per
    class; a DS4 config adds its own requirement first (see the module docstring).
    """
    chunks = _chunks(model)
    if tf_config is None and chunks:
        tf_config = getattr(chunks[0], "config", None)
    return _consumers(chunks, tf_config).requirements


# --------------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------------


def _explicit(user_overrides: Mapping | None, key: str):
    if not user_overrides:
        return None
    return user_overrides.get(key, None)


def transformer_config_fills(
    hf_config,
    *,
    user_overrides: Mapping | None,
    cp_size: int,
    tp_size: int,
    dynamic_cp: bool = False,
    config_fields: Iterable[str] | None = None,
    api: "megatron_api.CPLayoutAPI | None" = None,
) -> dict[str, Any]:
    """Values to fill into ``override_transformer_config`` before the model is built.

    Returns only keys the user did not set and the installed ``TransformerConfig`` has. Raises
    :class:`CPLayoutError` for settings DS4 cannot run with (explicit zigzag, an unsupported
    packing scheduler, TP > 1).
    """
    api = api or megatron_api.installed_api()
    api.check_overrides(user_overrides)  # a layout key of the other Megatron spelling: refused for any model
    v41 = is_ds41_hf_config(hf_config)
    if not (is_ds4_hf_config(hf_config) or v41):
        return {}
    user = dict(user_overrides or {})
    mode = user.get(CP_PARTITION_MODE) or api.explicit_layout(user)
    _raise_if(
        ds4_facts.check_tensor_parallel(tp_size),
        ds4_facts.check_cp_partition_mode(mode, cp_size, dynamic_cp, V41_ATTENTION if v41 else V4_ATTENTION),
        ds4_facts.check_packing_scheduler(user.get(SEQUENCE_PACKING_SCHEDULER), cp_size, dynamic_cp),
    )
    if not (cp_size > 1 or dynamic_cp):
        return {}
    fields = transformer_config_fields() if config_fields is None else frozenset(config_fields)
    fills = ds4_facts.fill_transformer_config(user, fields, cp_size, dynamic_cp)
    if api.kind == megatron_api.MAIN:  # Megatron-LM main's words for the same layout
        fills.update({k: v for k, v in api.config_fills(CONTIGUOUS, user).items() if k in fields})
    return fills


def _raise_if(*violations: "ds4_facts.Violation | None") -> None:
    """Raise the first DS4 rule violation as a start-up :class:`CPLayoutError`."""
    for violation in violations:
        if violation is not None:
            raise CPLayoutError(violation.engine_message())


def _format_requirements(consumers: Iterable[LayoutRequirement]) -> str:
    """One phrase per kind of consumer (same class and needs), naming its first module and a count."""
    groups: dict[tuple, list[LayoutRequirement]] = {}
    for r in consumers:
        kind = r.source.rsplit("(", 1)[-1] if r.source.endswith(")") else r.source
        groups.setdefault((kind, r.layout, r.min_local_rows, r.accepts), []).append(r)
    parts = []
    for (_, layout, min_rows, _), members in groups.items():
        extra = f", >= {min_rows} rows/rank" if min_rows else ""
        more = f" and {len(members) - 1} more like it" if len(members) > 1 else ""
        parts.append(f"{members[0].source}{more} needs {layout}{extra}")
    return "; ".join(parts)


def _format_undeclared(sources: list[str]) -> str:
    shown = ", ".join(sources[:4])
    return shown + (f" and {len(sources) - 4} more" if len(sources) > 4 else "")


def _check_consumers(consumers: _Consumers, cp_possible: bool) -> frozenset[str]:
    """The modes every consumer accepts; under CP, undeclared attention and conflicts are errors."""
    reqs = consumers.requirements
    if not cp_possible:
        accepted = frozenset(LAYOUTS)
        for r in reqs:
            accepted &= r.accepts
        return accepted or frozenset(r.layout for r in reqs)  # CP=1: nothing is split
    if consumers.undeclared:
        raise CPLayoutError(
            "with context parallelism every attention module must say which CP partition mode it consumes, but "
            f"{_format_undeclared(consumers.undeclared)} declares none and is not a module the resolver knows "
            f"({', '.join(f'{p}*.{n}' for p, n in KNOWN_CP_PARTITION_MODES)}). Declare "
            f"{requirements.REQUIRED_ATTRIBUTE} ('contiguous' / 'zigzag') and {requirements.MIN_ROWS_ATTRIBUTE} "
            "on its class (see verl_ds4.mcore.requirements), or set context_parallel_size=1."
        )
    if not reqs:
        raise CPLayoutError(
            "with context parallelism the resolver needs the model's attention modules, but it found none "
            "(no module declares required_cp_partition_mode, none is a Megatron-Core Attention or a known core "
            "attention, and the config selects no attention variant). Declare required_cp_partition_mode and "
            "min_local_rows on the attention class (see verl_ds4.mcore.requirements), or set context_parallel_size=1."
        )
    accepted = frozenset(LAYOUTS)
    for r in reqs:
        accepted &= r.accepts
    if not accepted:
        raise CPLayoutError(
            "attention modules need different CP partition modes and none converts: "
            f"{_format_requirements(reqs)}. Use one attention implementation for every layer, give a module a "
            f"converter (declare it in {requirements.ACCEPTED_ATTRIBUTE}), or set context_parallel_size=1."
        )
    return accepted


def _choose_layout(reqs: list[LayoutRequirement], accepted: frozenset[str], preferred, cp_possible: bool) -> str:
    """The mode to split by: the user's / config's if every consumer accepts it, else the one they require."""
    if preferred in accepted:
        return preferred
    if not cp_possible and reqs[0].layout in accepted:
        return reqs[0].layout  # CP=1: nothing is split, the first consumer's mode (as always)
    native = [mode for mode in LAYOUTS if mode in accepted and any(r.layout == mode for r in reqs)]
    if len(native) == 1:
        return native[0]
    if not native and len(accepted) == 1:
        return next(iter(accepted))
    raise CPLayoutError(
        f"the attention modules can all consume {' and '.join(sorted(accepted))} ({_format_requirements(reqs)}), "
        "so the CP partition mode is not determined. Set override_transformer_config.cp_partition_mode to one of them."
    )


def resolve_cp_layout(
    model,
    tf_config=None,
    *,
    cp_size: int,
    tp_size: int = 1,
    dynamic_cp: bool = False,
    pad_to_length_bucket: int | None = None,
    user_overrides: Mapping | None = None,
    balance: "str | TokenCostModel | None" = None,
) -> ResolvedCPLayout:
    """Decide the CP layout and padding of ``model`` (a module or a list of pipeline chunks).

    ``balance`` (the engine's ``cp_balance``) needs the contiguous layout.

    Raises :class:`CPLayoutError` at start-up when the attention modules, the config and the
    user's settings cannot agree.
    """
    chunks = _chunks(model)
    if tf_config is None:
        tf_config = getattr(chunks[0], "config", None) if chunks else None
    if tf_config is not None and _is_ds4_config(tf_config):
        _raise_if(ds4_facts.check_tensor_parallel(tp_size))
    if pad_to_length_bucket is not None and (
        isinstance(pad_to_length_bucket, bool) or not isinstance(pad_to_length_bucket, int) or pad_to_length_bucket < 1
    ):
        raise CPLayoutError(f"pad_to_length_bucket must be a positive int, got {pad_to_length_bucket!r}")

    cp_possible = cp_size > 1 or dynamic_cp
    consumers = _consumers(chunks, tf_config)
    reqs = consumers.requirements
    accepted = _check_consumers(consumers, cp_possible)

    api = megatron_api.installed_api()
    config_mode = None
    if tf_config is not None:
        config_mode = api.config_layout(tf_config) or getattr(tf_config, CP_PARTITION_MODE, None)
    explicit_mode = _explicit(user_overrides, CP_PARTITION_MODE) or api.explicit_layout(user_overrides)
    if explicit_mode is not None and explicit_mode not in LAYOUTS:
        raise CPLayoutError(f"override_transformer_config.cp_partition_mode={explicit_mode!r}; expected one of {LAYOUTS}")

    sources: list[str] = []
    if explicit_mode is not None and cp_possible and explicit_mode not in accepted:
        blocking = [r for r in reqs if explicit_mode not in r.accepts]
        raise CPLayoutError(
            f"override_transformer_config.cp_partition_mode={explicit_mode!r} with context parallelism, but "
            f"{_format_requirements(blocking)}; it cannot consume {explicit_mode}. "
            f"Remove the override (the layout is then {'/'.join(sorted(accepted))})."
        )
    if reqs:
        layout = _choose_layout(reqs, accepted, explicit_mode or config_mode, cp_possible)
        sources.append(_format_requirements(reqs))
        if explicit_mode is not None:
            sources.append(f"user cp_partition_mode={explicit_mode!r}")
    elif explicit_mode is not None:  # CP=1 only (under CP a model without consumers is an error)
        layout = explicit_mode
        sources.append(f"user cp_partition_mode={explicit_mode!r}")
    elif config_mode in LAYOUTS:
        layout = config_mode
        sources.append(f"TransformerConfig.cp_partition_mode={config_mode!r}")
    else:
        layout = ZIGZAG
        sources.append("CP=1: no attention module declares a partition mode; nothing is split")

    if cp_possible and config_mode is not None and config_mode != layout and any(
        not r.self_describing for r in reqs
    ):
        raise CPLayoutError(
            f"TransformerConfig.cp_partition_mode={config_mode!r} but the model's attention needs {layout} "
            f"({_format_requirements(reqs)}). Set override_transformer_config.cp_partition_mode={layout}."
        )

    if layout == CONTIGUOUS and cp_possible and not (api.can_tell_attention or packed_seq_params_has_cp_partition_mode()):
        # Modules that declare the protocol read the split from the rows; everything else must be
        # told through PackedSeqParams.
        told_only = [r for r in reqs if not r.self_describing]
        if told_only:
            raise CPLayoutError(
                "the contiguous CP layout with context parallelism must be told to Megatron's attention, and the "
                "installed Megatron-Core has neither API for it: Megatron-LM dev's PackedSeqParams.cp_partition_mode / "
                "TransformerConfig.cp_partition_mode, nor Megatron-LM main's TransformerConfig.attention_cp_layout / "
                f"linear_cp_layout ({_format_requirements(told_only)}). Install a Megatron-Core with one of them "
                "(Megatron-LM dev, see docker/), use attention modules that declare "
                f"{requirements.REQUIRED_ATTRIBUTE}, or set context_parallel_size=1."
            )

    min_rows = [r.min_local_rows for r in reqs if r.min_local_rows and layout in r.accepts]
    fp8 = getattr(tf_config, "fp8", None) if tf_config is not None else None
    return ResolvedCPLayout(
        layout=layout,
        min_local_rows=max(min_rows) if min_rows else None,
        cp_size=int(cp_size),
        tp_size=int(tp_size),
        pad_to_length_bucket=pad_to_length_bucket,
        fp8_padding=fp8 in ("e4m3", "hybrid"),
        dynamic_cp=bool(dynamic_cp),
        sources=tuple(sources),
        balance=balance,
    )


# --------------------------------------------------------------------------------------------
# Who holds the result
# --------------------------------------------------------------------------------------------


#: The engines' resolved layouts, by model chunk (every wrapper level) and TransformerConfig.
REGISTRY: IdentityRegistry = IdentityRegistry()


def _wrapper_levels(chunk: torch.nn.Module):
    """``chunk`` and the modules it wraps (``.module`` of DDP / Float16Module)."""
    target = chunk
    while isinstance(target, torch.nn.Module):
        yield target
        target = getattr(target, "module", None)


def register_layout(model, resolved: ResolvedCPLayout, tf_config=None) -> None:
    """Record ``resolved`` for every model chunk (each wrapper level), their configs and ``tf_config``."""
    if not isinstance(resolved, ResolvedCPLayout):
        raise TypeError(f"expected a ResolvedCPLayout, got {type(resolved).__name__}")  # error-catalogue: internal: a caller passed a bad argument
    for chunk in _chunks(model):
        for level in _wrapper_levels(chunk):
            REGISTRY.set(level, resolved)
            config = getattr(level, "config", None)
            if dataclasses.is_dataclass(config) and not isinstance(config, type):  # a TransformerConfig
                REGISTRY.set(config, resolved)
    if tf_config is not None:
        REGISTRY.set(tf_config, resolved)


def layout_of(model_or_config) -> ResolvedCPLayout | None:
    """The layout :func:`register_layout` recorded for a model chunk (any wrapper level) or config."""
    if isinstance(model_or_config, torch.nn.Module):
        for level in _wrapper_levels(model_or_config):
            found = REGISTRY.get(level)
            if found is not None:
                return found
        return None
    return REGISTRY.get(model_or_config) if model_or_config is not None else None


def resolved_for(model, **kwargs) -> ResolvedCPLayout:
    """The layout registered for ``model``; resolved once (with ``kwargs``) and registered if there is none.

    Used by callers outside the engine (tests, scripts) that call the forward functions directly.
    ``cp_size`` / ``tp_size`` default to Megatron's parallel state.
    """
    chunks = _chunks(model)
    found = layout_of(chunks[0]) if chunks else None
    if found is not None:
        return found
    if "cp_size" not in kwargs or "tp_size" not in kwargs:
        from megatron.core import parallel_state as mpu

        kwargs.setdefault("cp_size", mpu.get_context_parallel_world_size())
        kwargs.setdefault("tp_size", mpu.get_tensor_model_parallel_world_size())
    resolved = resolve_cp_layout(model, **kwargs)
    register_layout(model, resolved)
    logger.info("verl-ds4: %s", resolved.describe())
    return resolved
