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
* ``TransformerConfig.experimental_attention_variant == "dsv4_hybrid"`` (DeepSeek-V4 on
  Megatron-LM dev): ``contiguous`` with at least ``csa_window_size`` rows per CP rank, TP = 1.
* TransformerEngine / Megatron-Core ``DotProductAttention``: ``zigzag``.
* Any module that declares the **CP layout protocol** (below), for example the project's
  pure-PyTorch DS4 attention: whatever it declares.
* ``cp_partition_mode`` on the config, where the installed Megatron-Core has that field: the
  user's explicit value is honoured if the attention modules can consume it.

CP layout protocol (duck-typed; implementers need not import this module)
--------------------------------------------------------------------------
An ``nn.Module`` anywhere inside the model declares what it consumes with an attribute (or a
property, or a zero-argument method) named ``cp_layout_requirement``. Its value is either

* a tuple ``(layout, min_local_rows)`` or ``(layout, min_local_rows, accepts)``, or
* an object with attributes ``layout``, ``min_local_rows`` and optionally ``accepts``,

where ``layout`` is ``"contiguous"`` or ``"zigzag"`` (the layout the module consumes natively),
``min_local_rows`` is ``None`` or a positive int (the fewest rows every CP rank must hold; the
batch is padded up to ``cp * min_local_rows``), and ``accepts`` is an optional iterable of further
layouts the module can consume because it converts them itself (a module without a converter
leaves it out). Example, on the DS4 attention::

    @property
    def cp_layout_requirement(self):
        return ("contiguous", self.config.csa_window_size)

A second spelling is accepted too: a string attribute ``cp_layout`` (``"contiguous"`` /
``"zigzag"``) together with ``min_local_rows`` (an int, ``None``, or a zero-argument method), as
the DS4 proxy's ``DS4HybridSelfAttention`` declares it.

A declaring module reads the layout from the packed rows it is given (global ``cu_seqlens``,
``cp_rank * local_rows`` as its first row, and ``packed_seq_params.cp_partition_mode``, which
:mod:`verl_ds4.mcore.thd` always records, as a plain attribute where the installed
``PackedSeqParams`` lacks the field), so it works on any Megatron-Core; Megatron's own attention
needs the field. When the config selects the DS4 variant and the model's attention modules declare
the protocol, they are what consumes the rows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl_ds4 import ds4_facts

logger = logging.getLogger(__name__)

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)


PROTOCOL_ATTRIBUTE = "cp_layout_requirement"
#: Attribute under which the resolved layout is cached on each model chunk and its config.
RESOLVED_ATTRIBUTE = "_verl_ds4_cp_layout"

# The keys of ``override_transformer_config`` whose values the resolver owns.
CP_PARTITION_MODE = "cp_partition_mode"
SEQUENCE_PACKING_SCHEDULER = "sequence_packing_scheduler"
OWNED_OVERRIDE_KEYS = (CP_PARTITION_MODE, SEQUENCE_PACKING_SCHEDULER)


class CPLayoutError(ValueError):
    """A start-up error: the model's attention, its config and the user's settings disagree."""


@dataclass(frozen=True)
class LayoutRequirement:
    """What one consumer of the packed rows needs.

    ``source`` names the consumer (a module path and class, or a config field) for error messages.
    ``accepts`` is every layout the consumer can take (its native ``layout`` included).
    """

    layout: str
    min_local_rows: int | None
    source: str
    accepts: frozenset[str]
    #: True when the consumer reads the layout from the packed rows themselves (a module that
    #: declares the protocol), False when it must be told through ``PackedSeqParams``.
    self_describing: bool = False


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
    """

    layout: str
    min_local_rows: int | None
    cp_size: int
    tp_size: int
    pad_to_length_bucket: int | None = None
    fp8_padding: bool = False
    dynamic_cp: bool = False
    sources: tuple[str, ...] = ()
    balance: str | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise CPLayoutError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.balance is not None and self.layout != CONTIGUOUS:
            raise CPLayoutError(
                f"cp_balance={self.balance!r} reorders the sequences of the contiguous CP layout, but this engine's "
                f"layout is {self.layout!r}. Set cp_balance=null (recipe knob ds4.cp_balance), or use an attention "
                "that consumes the contiguous layout."
            )
        for name in ("cp_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CPLayoutError(f"{name} must be a positive int, got {value!r}")
        for name in ("min_local_rows", "pad_to_length_bucket"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise CPLayoutError(f"{name} must be None or a positive int, got {value!r}")

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
        balance = f", sequence order balanced under the {self.balance} cost model" if self.balance else ""
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


def is_ds4_hf_config(hf_config) -> bool:
    """Whether a Hugging Face config describes a model Megatron-Bridge builds with DS4 attention."""
    return getattr(hf_config, "model_type", None) == ds4_facts.HF_MODEL_TYPE


def _normalise_requirement(value, source: str) -> LayoutRequirement:
    if callable(value) and not isinstance(value, tuple):
        value = value()
    if isinstance(value, tuple):
        if len(value) not in (2, 3):
            raise CPLayoutError(
                f"{source}: {PROTOCOL_ATTRIBUTE} must be (layout, min_local_rows) or "
                f"(layout, min_local_rows, accepts), got {value!r}"
            )
        layout, min_rows = value[0], value[1]
        accepts = value[2] if len(value) == 3 else ()
    else:
        try:
            layout, min_rows = value.layout, value.min_local_rows
        except AttributeError:
            raise CPLayoutError(
                f"{source}: {PROTOCOL_ATTRIBUTE} must be a tuple or have .layout and .min_local_rows, got {value!r}"
            ) from None
        accepts = getattr(value, "accepts", ()) or ()
    layout = getattr(layout, "value", layout)  # tolerate enums
    if layout not in LAYOUTS:
        raise CPLayoutError(f"{source}: declares CP layout {layout!r}; expected one of {LAYOUTS}")
    if min_rows is not None and (isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1):
        raise CPLayoutError(f"{source}: declares min_local_rows={min_rows!r}; expected None or a positive int")
    accepts = frozenset([layout, *(getattr(a, "value", a) for a in accepts)])
    unknown = accepts - set(LAYOUTS)
    if unknown:
        raise CPLayoutError(f"{source}: declares it accepts unknown CP layouts {sorted(unknown)}")
    return LayoutRequirement(layout, min_rows, source, accepts, self_describing=True)


def _is_standard_attention(module: torch.nn.Module) -> bool:
    """Megatron-Core's or TransformerEngine's DotProductAttention (they consume zigzag)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "DotProductAttention" and cls.__module__.startswith(("megatron.core", "transformer_engine")):
            return True
    return False


def _chunks(model) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    return list(model)


def collect_requirements(model, tf_config=None) -> list[LayoutRequirement]:
    """Every layout requirement in ``model`` (a module or a list of pipeline chunks).

    Declaring modules are reported one by one; Megatron / TE attention modules are grouped by class.
    When the config selects DS4's hybrid attention, that variant owns the attention path and
    Megatron / TE attention modules inside it are not counted separately.
    """
    chunks = _chunks(model)
    if tf_config is None and chunks:
        tf_config = getattr(chunks[0], "config", None)
    requirements: list[LayoutRequirement] = []
    ds4 = tf_config is not None and _is_ds4_config(tf_config)
    if ds4:
        requirements.append(
            LayoutRequirement(
                CONTIGUOUS,
                _ds4_window(tf_config),
                f"TransformerConfig.experimental_attention_variant={ds4_facts.ATTENTION_VARIANT!r}",
                frozenset([CONTIGUOUS]),
            )
        )
    standard: dict[str, str] = {}  # class name -> first module path
    declared_any = False
    for index, chunk in enumerate(chunks):
        prefix = f"model[{index}]." if len(chunks) > 1 else ""
        for name, module in chunk.named_modules():
            source = f"{prefix}{name or '<root>'} ({type(module).__name__})"
            declared = _declared_requirement(module)
            if declared is not None:
                requirements.append(_normalise_requirement(declared, source))
                declared_any = True
            elif not ds4 and _is_standard_attention(module):
                standard.setdefault(type(module).__name__, source)
    for source in standard.values():
        requirements.append(LayoutRequirement(ZIGZAG, None, source, frozenset([ZIGZAG])))
    if ds4 and declared_any:
        # The DS4 attention of this model is a declaring module (e.g. the pure-PyTorch one), not
        # Megatron-LM dev's: it reads the split from the rows, so nothing needs PackedSeqParams' field.
        requirements[0] = dataclasses.replace(requirements[0], self_describing=True)
    return requirements


def _declared_requirement(module: torch.nn.Module):
    """The module's protocol value: ``cp_layout_requirement``, or the ``cp_layout`` / ``min_local_rows`` pair."""
    try:
        declared = getattr(module, PROTOCOL_ATTRIBUTE)
    except AttributeError:
        declared = None
    if declared is not None:
        return declared
    layout = getattr(module, "cp_layout", None)
    if not isinstance(layout, str) or layout not in LAYOUTS:
        return None
    min_rows = getattr(module, "min_local_rows", None)
    if callable(min_rows):
        min_rows = min_rows()
    return (layout, min_rows)


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
) -> dict[str, Any]:
    """Values to fill into ``override_transformer_config`` before the model is built.

    Returns only keys the user did not set and the installed ``TransformerConfig`` has. Raises
    :class:`CPLayoutError` for settings DS4 cannot run with (explicit zigzag, an unsupported
    packing scheduler, TP > 1).
    """
    if not is_ds4_hf_config(hf_config):
        return {}
    user = dict(user_overrides or {})
    _raise_if(
        ds4_facts.check_tensor_parallel(tp_size),
        ds4_facts.check_cp_partition_mode(user.get(CP_PARTITION_MODE), cp_size, dynamic_cp),
        ds4_facts.check_packing_scheduler(user.get(SEQUENCE_PACKING_SCHEDULER), cp_size, dynamic_cp),
    )
    if not (cp_size > 1 or dynamic_cp):
        return {}
    fields = transformer_config_fields() if config_fields is None else frozenset(config_fields)
    return ds4_facts.fill_transformer_config(user, fields, cp_size, dynamic_cp)


def _raise_if(*violations: "ds4_facts.Violation | None") -> None:
    """Raise the first DS4 rule violation as a start-up :class:`CPLayoutError`."""
    for violation in violations:
        if violation is not None:
            raise CPLayoutError(violation.engine_message())


def _format_requirements(requirements: Iterable[LayoutRequirement]) -> str:
    """One phrase per kind of consumer (same class and needs), naming its first module and a count."""
    groups: dict[tuple, list[LayoutRequirement]] = {}
    for r in requirements:
        kind = r.source.rsplit("(", 1)[-1] if r.source.endswith(")") else r.source
        groups.setdefault((kind, r.layout, r.min_local_rows, r.accepts), []).append(r)
    parts = []
    for (_, layout, min_rows, _), members in groups.items():
        extra = f", >= {min_rows} rows/rank" if min_rows else ""
        more = f" and {len(members) - 1} more like it" if len(members) > 1 else ""
        parts.append(f"{members[0].source}{more} needs {layout}{extra}")
    return "; ".join(parts)


def resolve_cp_layout(
    model,
    tf_config=None,
    *,
    cp_size: int,
    tp_size: int = 1,
    dynamic_cp: bool = False,
    pad_to_length_bucket: int | None = None,
    user_overrides: Mapping | None = None,
    balance: str | None = None,
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

    requirements = collect_requirements(chunks, tf_config)
    cp_possible = cp_size > 1 or dynamic_cp

    accepted = frozenset(LAYOUTS)
    for r in requirements:
        accepted &= r.accepts
    if not accepted:
        if cp_possible:
            raise CPLayoutError(
                "attention modules need different CP layouts and none converts: "
                f"{_format_requirements(requirements)}. Use one attention implementation for every layer, "
                f"give a module a converter (declare it in {PROTOCOL_ATTRIBUTE}'s accepts), or set "
                "context_parallel_size=1."
            )
        accepted = frozenset(r.layout for r in requirements)

    config_mode = getattr(tf_config, CP_PARTITION_MODE, None) if tf_config is not None else None
    explicit_mode = _explicit(user_overrides, CP_PARTITION_MODE)
    if explicit_mode is not None and explicit_mode not in LAYOUTS:
        raise CPLayoutError(f"override_transformer_config.cp_partition_mode={explicit_mode!r}; expected one of {LAYOUTS}")

    sources: list[str] = []
    if explicit_mode is not None and cp_possible and explicit_mode not in accepted:
        consumers = [r for r in requirements if explicit_mode not in r.accepts]
        raise CPLayoutError(
            f"override_transformer_config.cp_partition_mode={explicit_mode!r} with context parallelism, but "
            f"{_format_requirements(consumers)}; it cannot consume {explicit_mode}. "
            f"Remove the override (the layout is then {'/'.join(sorted(accepted))})."
        )
    if requirements:
        preferred = explicit_mode or config_mode
        if preferred in accepted:
            layout = preferred
        else:
            layout = requirements[0].layout if requirements[0].layout in accepted else sorted(accepted)[0]
        sources.append(_format_requirements(requirements))
        if explicit_mode is not None:
            sources.append(f"user cp_partition_mode={explicit_mode!r}")
    elif explicit_mode is not None:
        layout = explicit_mode
        sources.append(f"user cp_partition_mode={explicit_mode!r}")
    elif config_mode in LAYOUTS:
        layout = config_mode
        sources.append(f"TransformerConfig.cp_partition_mode={config_mode!r}")
    else:
        layout = ZIGZAG
        sources.append("default (no attention module declares a layout)")

    if cp_possible and config_mode is not None and config_mode != layout and any(
        not r.self_describing for r in requirements
    ):
        raise CPLayoutError(
            f"TransformerConfig.cp_partition_mode={config_mode!r} but the model's attention needs {layout} "
            f"({_format_requirements(requirements)}). Set override_transformer_config.cp_partition_mode={layout}."
        )

    if layout == CONTIGUOUS and cp_possible and not packed_seq_params_has_cp_partition_mode():
        # Modules that declare the protocol read the split from the rows; everything else (and an
        # attention nobody recognised) must be told through PackedSeqParams.
        told_only = [r for r in requirements if not r.self_describing]
        if not requirements:
            told_only = [LayoutRequirement(CONTIGUOUS, None, sources[-1], frozenset([CONTIGUOUS]))]
        if told_only:
            raise CPLayoutError(
                "the contiguous CP layout with context parallelism needs PackedSeqParams.cp_partition_mode to "
                "tell Megatron's attention how rows are split, and the installed Megatron-Core lacks it "
                f"({_format_requirements(told_only)}). Install a Megatron-Core that has cp_partition_mode "
                "(Megatron-LM dev, see docker/), use an attention module that declares "
                f"{PROTOCOL_ATTRIBUTE}, or set context_parallel_size=1."
            )

    min_rows = [r.min_local_rows for r in requirements if r.min_local_rows and layout in r.accepts]
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


def attach(model, resolved: ResolvedCPLayout, tf_config=None) -> None:
    """Cache ``resolved`` on every model chunk (and its config) so each data path reads the same object."""
    for chunk in _chunks(model):
        target = chunk
        while True:
            setattr(target, RESOLVED_ATTRIBUTE, resolved)
            inner = getattr(target, "module", None)
            if not isinstance(inner, torch.nn.Module):
                break
            target = inner
        config = getattr(target, "config", None)
        if config is not None:
            setattr(config, RESOLVED_ATTRIBUTE, resolved)
    if tf_config is not None:
        setattr(tf_config, RESOLVED_ATTRIBUTE, resolved)


def attached(model_or_config) -> ResolvedCPLayout | None:
    """The layout :func:`attach` cached on a model chunk (any wrapper level) or config, if any."""
    target = model_or_config
    while target is not None:
        found = getattr(target, RESOLVED_ATTRIBUTE, None)
        if isinstance(found, ResolvedCPLayout):
            return found
        inner = getattr(target, "module", None)
        target = inner if isinstance(inner, torch.nn.Module) else None
    return None


def resolved_for(model, **kwargs) -> ResolvedCPLayout:
    """The layout attached to ``model``; resolved once (with ``kwargs``) and attached if there is none.

    Used by callers outside the engine (tests, scripts) that call the forward functions directly.
    ``cp_size`` / ``tp_size`` default to Megatron's parallel state.
    """
    found = attached(model)
    if found is not None:
        return found
    if "cp_size" not in kwargs or "tp_size" not in kwargs:
        from megatron.core import parallel_state as mpu

        kwargs.setdefault("cp_size", mpu.get_context_parallel_world_size())
        kwargs.setdefault("tp_size", mpu.get_tensor_model_parallel_world_size())
    resolved = resolve_cp_layout(model, **kwargs)
    attach(model, resolved)
    logger.info("verl-ds4: %s", resolved.describe())
    return resolved


def layout_for_config(tf_config) -> ResolvedCPLayout | None:
    """The layout attached to a config by :func:`attach` (``None`` when the engine did not resolve one)."""
    found = getattr(tf_config, RESOLVED_ATTRIBUTE, None)
    return found if isinstance(found, ResolvedCPLayout) else None
