"""What each attention module of a model requires of the CP split: the CP partition-mode protocol.

:mod:`verl_ds4.mcore.resolver` decides the layout; this module only reads what the modules say.
The words are Megatron-LM ``dev``'s: ``cp_partition_mode`` on ``PackedSeqParams`` /
``TransformerConfig``, with the values ``"zigzag"`` and ``"contiguous"``.

The protocol (duck-typed; implementers need not import this module)
--------------------------------------------------------------------
An attention ``nn.Module`` declares, as class attributes or properties:

``required_cp_partition_mode``
    ``"contiguous"`` or ``"zigzag"``: the split of the global packed buffer the module consumes.
``min_local_rows``
    ``None`` or a positive int: the fewest rows every CP rank must hold (the engine pads the
    packed buffer to at least ``cp * min_local_rows`` rows). A value, not a method.
``accepted_cp_partition_modes`` (optional)
    further modes the module can consume because it converts them itself (a module without a
    converter leaves it out). Its own ``required_cp_partition_mode`` is always accepted.

Example, on the project's DS4 attention::

    required_cp_partition_mode = "contiguous"

    @property
    def min_local_rows(self) -> int:
        return self.spec.min_local_rows

A declaring module speaks for everything inside it (its submodules are not read). It reads the
split from the packed rows it is given (global ``cu_seqlens``, ``cp_rank * local_rows`` as its first
row, and ``packed_seq_params.cp_partition_mode``, which :mod:`verl_ds4.mcore.thd` always records),
so it works on any Megatron-Core.

Modules that do not declare
---------------------------
:data:`KNOWN_CP_PARTITION_MODES` is the one table of modules known to consume a mode without
declaring it (matched on the class or any base class, by module prefix and class name).

Which modules are attention modules: every declaring module, every module in the table, and the
``core_attention`` of every Megatron-Core ``Attention`` (``SelfAttention``, ``CrossAttention``,
``MLASelfAttention``, ...). A ``core_attention`` that is neither declared nor in the table is
reported by name (:attr:`ModuleScan.undeclared`); the resolver refuses it under CP.

A DeepSeek-V4.1 config (``dsv4_version == "v4.1"``) adds its own requirement
(:func:`ds41_config_requirement`: contiguous, :func:`ds41_min_rows` rows per rank), and every attention
module of such a model must be declared or in the table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)

#: The protocol's attribute names.
REQUIRED_ATTRIBUTE = "required_cp_partition_mode"
MIN_ROWS_ATTRIBUTE = "min_local_rows"
ACCEPTED_ATTRIBUTE = "accepted_cp_partition_modes"

#: Modules known to consume one CP partition mode without declaring it:
#: ``(module prefix, class name) -> mode``. A class matches when it or a base class has that name
#: and lives in a module whose dotted name starts with the prefix.
KNOWN_CP_PARTITION_MODES: dict[tuple[str, str], str] = {
    # Megatron-Core's local attention and TransformerEngine's (Megatron's TEDotProductAttention
    # subclasses it): Megatron's zigzag split (each rank holds chunks r and 2cp-1-r of a sequence).
    ("megatron.core", "DotProductAttention"): ZIGZAG,
    ("megatron.core", "TEDotProductAttention"): ZIGZAG,
    ("transformer_engine", "DotProductAttention"): ZIGZAG,
    # The dev branch's DeepSeek-V4.1 core attention (every V4.1 layer: window-only, Full, Reindex, Reuse).
    # megatron.core source read at e80d15ffa5 (``experimental_attention_variant/csa2.py``:
    # ``CompressedSparseAttention2``) and after the refactor into the ``csa2/`` package (02ab972cd1,
    # b8ac8e6697: ``csa2/attention.py``'s ``CSA2Attention`` inside ``DSv41SelfAttention``, built by
    # ``models/deepseek_v41/layer_specs.hybrid_dsv41_stack_spec``). Their packed path splits the flat
    # row axis into contiguous blocks (``csa2/thd.py``; ``csa_utils/thd_utils.build_csa2_thd_layout``
    # at 09b70a5933 raises "CSA2 THD CP requires a contiguous partition" unless
    # ``PackedSeqParams.cp_partition_mode`` is "contiguous" with CP > 1) and takes a left halo from the
    # previous rank (``csa_utils/csa2_context_parallel.py``). Rows per rank: the V4.1 config's rule
    # (the resolver). Same prefix for the module and the package.
    ("megatron.core.transformer.experimental_attention_variant.csa2", "CompressedSparseAttention2"): CONTIGUOUS,
    ("megatron.core.transformer.experimental_attention_variant.csa2", "CSA2Attention"): CONTIGUOUS,
}

#: The CSA2 core-attention entries above (tests and ``verl-ds4 doctor`` look for them).
DS41_CORE_ATTENTIONS = (
    ("megatron.core.transformer.experimental_attention_variant.csa2", "CompressedSparseAttention2"),
    ("megatron.core.transformer.experimental_attention_variant.csa2", "CSA2Attention"),
)


class CPLayoutError(ValueError):
    """A start-up error: the model's attention, its config and the user's settings disagree.

    Defined here (the resolver re-exports it) because a malformed declaration is one such error.
    """


@dataclass(frozen=True)
class LayoutRequirement:
    """What one consumer of the packed rows needs.

    ``source`` names the consumer (a module path and class, or a config field) for error messages.
    ``accepts`` is every mode the consumer can take (its native ``layout`` included).
    """

    layout: str
    min_local_rows: int | None
    source: str
    accepts: frozenset[str]
    #: True when the consumer reads the split from the packed rows themselves (a module that
    #: declares the protocol), False when it must be told through ``PackedSeqParams``.
    self_describing: bool = False


@dataclass
class ModuleScan:
    """The attention modules of a model, by what they say about the CP split."""

    #: One requirement per declaring module.
    declared: list[LayoutRequirement] = field(default_factory=list)
    #: Modules of :data:`KNOWN_CP_PARTITION_MODES`, one requirement per class (its first module).
    known: list[LayoutRequirement] = field(default_factory=list)
    #: ``core_attention`` modules that neither declare nor are known: ``"path (Class)"`` each.
    undeclared: list[str] = field(default_factory=list)


#: Megatron-LM dev's V4.1 switch on ``TransformerConfig`` (``dsv4_version``) and its value.
DSV4_VERSION_FIELD, DS41_VERSION = "dsv4_version", "v4.1"
#: Megatron's own default of ``engram_max_ngram_size`` (``EngramConfig.from_transformer_config``).
MEGATRON_ENGRAM_MAX_NGRAM_DEFAULT = 3


def is_ds41_config(tf_config) -> bool:
    return getattr(tf_config, DSV4_VERSION_FIELD, None) == DS41_VERSION


def ds41_min_rows(tf_config) -> int:
    """Rows every CP rank needs for V4.1: the config's own ``min_local_rows`` (``DS41TransformerConfig``)
    or ``max(window, largest ratio, Engram lookback)`` from Megatron-LM dev's field names."""
    own = getattr(tf_config, "min_local_rows", None)
    if isinstance(own, int) and not isinstance(own, bool) and own > 0:
        return own
    window = getattr(tf_config, "csa_window_size", None)
    if not isinstance(window, int) or window < 1:
        raise CPLayoutError(
            f"TransformerConfig.{DSV4_VERSION_FIELD}={DS41_VERSION!r} but csa_window_size={window!r}; expected the "
            "V4.1 window (a positive int, 128 for Flash). Set it from the checkpoint's sliding_window."
        )
    ratios = [int(r) for r in (getattr(tf_config, "csa_compress_ratios", None) or ())]
    lookback = 0
    if getattr(tf_config, "engram_layer_ids", None):
        n = getattr(tf_config, "engram_max_ngram_size", None) or MEGATRON_ENGRAM_MAX_NGRAM_DEFAULT
        lookback = int(n) - 1
    return max([window, lookback, *ratios])


def ds41_config_requirement(tf_config, attention: str, self_describing: bool) -> LayoutRequirement:
    """The V4.1 config's own requirement: contiguous, :func:`ds41_min_rows` rows per CP rank."""
    return LayoutRequirement(
        CONTIGUOUS,
        ds41_min_rows(tf_config),
        f"TransformerConfig.{DSV4_VERSION_FIELD}={DS41_VERSION!r} ({attention})",
        frozenset([CONTIGUOUS]),
        self_describing=self_describing,
    )


def known_cp_partition_mode(module: torch.nn.Module) -> str | None:
    """The mode :data:`KNOWN_CP_PARTITION_MODES` lists for ``module``'s class, or ``None``."""
    for cls in type(module).__mro__:
        for (prefix, name), mode in KNOWN_CP_PARTITION_MODES.items():
            if cls.__name__ == name and cls.__module__.startswith(prefix):
                return mode
    return None


def declares(module: torch.nn.Module) -> bool:
    """Whether ``module`` declares the protocol (a non-``None`` ``required_cp_partition_mode``)."""
    return getattr(module, REQUIRED_ATTRIBUTE, None) is not None


def declared_requirement(module: torch.nn.Module, source: str) -> LayoutRequirement:
    """Read and check ``module``'s declaration; :class:`CPLayoutError` names ``source``."""
    mode = getattr(module, REQUIRED_ATTRIBUTE)
    if mode not in LAYOUTS:
        raise CPLayoutError(
            f"{source}: {REQUIRED_ATTRIBUTE}={mode!r}; expected one of {LAYOUTS}. Declare the CP partition "
            "mode the module consumes."
        )
    min_rows = getattr(module, MIN_ROWS_ATTRIBUTE, None)
    if callable(min_rows):
        raise CPLayoutError(
            f"{source}: {MIN_ROWS_ATTRIBUTE} is a method; expected None or a positive int. Make it a property."
        )
    if min_rows is not None and (isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1):
        raise CPLayoutError(f"{source}: declares min_local_rows={min_rows!r}; expected None or a positive int")
    extra = getattr(module, ACCEPTED_ATTRIBUTE, None) or ()
    if isinstance(extra, str) or not isinstance(extra, Iterable):
        raise CPLayoutError(
            f"{source}: {ACCEPTED_ATTRIBUTE}={extra!r}; expected a tuple of modes, e.g. ({CONTIGUOUS!r},)"
        )
    accepts = frozenset([mode, *extra])
    unknown = accepts - set(LAYOUTS)
    if unknown:
        raise CPLayoutError(
            f"{source}: {ACCEPTED_ATTRIBUTE} names unknown CP partition modes {sorted(unknown)}; expected {LAYOUTS}"
        )
    return LayoutRequirement(mode, min_rows, source, accepts, self_describing=True)


def _megatron_attention_class():
    from megatron.core.transformer.attention import Attention

    return Attention


def scan_attention_modules(chunks: Iterable[torch.nn.Module]) -> ModuleScan:
    """Every attention module of the model chunks, read once (see the module docstring)."""
    attention_cls = _megatron_attention_class()
    chunks = list(chunks)
    scan = ModuleScan()
    known_classes: set[type] = set()
    for index, chunk in enumerate(chunks):
        prefix = f"model[{index}]." if len(chunks) > 1 else ""
        handled: set[int] = set()  # ids of modules that declare, are known, or sit inside a declaring one
        for name, module in chunk.named_modules():
            path = f"{prefix}{name or '<root>'}"
            if id(module) in handled:
                for child in module.modules():
                    handled.add(id(child))
                continue
            source = f"{path} ({type(module).__name__})"
            if declares(module):
                scan.declared.append(declared_requirement(module, source))
                handled.update(id(child) for child in module.modules())
                continue
            mode = known_cp_partition_mode(module)
            if mode is not None:
                handled.add(id(module))
                if type(module) not in known_classes:
                    known_classes.add(type(module))
                    scan.known.append(LayoutRequirement(mode, None, source, frozenset([mode])))
        for name, module in chunk.named_modules():
            core = getattr(module, "core_attention", None) if isinstance(module, attention_cls) else None
            if isinstance(core, torch.nn.Module) and id(core) not in handled:
                scan.undeclared.append(f"{prefix}{name}.core_attention ({type(core).__name__})")
    return scan
