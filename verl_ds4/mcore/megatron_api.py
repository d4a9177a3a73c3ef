"""Which words the installed Megatron-Core uses to be told the CP layout (probed once, cached).

Two spellings exist:

* ``dev`` (Megatron-LM ``dev``): ``PackedSeqParams.cp_partition_mode`` and
  ``TransformerConfig.cp_partition_mode`` (``"zigzag"`` / ``"contiguous"``).
* ``main`` (Megatron-LM ``main``, package ``megatron.core.context_parallel``):
  ``TransformerConfig.attention_cp_layout`` / ``linear_cp_layout`` (the same two values) and
  ``PackedSeqParams.cp_partition_route`` (a precomputed zigzag<->contiguous route; ``None`` when
  the rows already arrive in the layout the attention consumes, as ours do). Megatron-LM main's
  docs keep ``cp_partition_mode`` as the module-boundary layout beside them; where the installed
  ``PackedSeqParams`` has it, it is set too.
* ``none`` (megatron-core 0.16.1): neither; only attention modules that read the split from the
  rows themselves (the protocol of :mod:`verl_ds4.mcore.requirements`) can run contiguous CP.

The probe reads dataclass fields only. A ``main`` config field wins when both are present.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from verl_ds4.mcore.requirements import CPLayoutError

__all__ = ["CPLayoutAPI", "installed_api", "probe"]

DEV, MAIN, NONE = "dev", "main", "none"
DEV_KEYS = ("cp_partition_mode",)
MAIN_KEYS = ("attention_cp_layout", "linear_cp_layout")
MAIN_ROUTE_FIELD = "cp_partition_route"


def _fields(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else frozenset()


@dataclasses.dataclass(frozen=True)
class CPLayoutAPI:
    """What the installed Megatron-Core reads; see the module docstring."""

    kind: str
    packed_fields: frozenset[str]
    config_fields: frozenset[str]

    @property
    def config_keys(self) -> tuple[str, ...]:
        """``override_transformer_config`` keys that tell this Megatron the layout."""
        return {DEV: DEV_KEYS, MAIN: MAIN_KEYS}.get(self.kind, ())

    @property
    def foreign_keys(self) -> tuple[str, ...]:
        """Layout keys of the other spelling, which this Megatron does not read.

        With neither API, ``cp_partition_mode`` stays the resolver's own preference key (the layout
        recorded for self-describing attention modules), as on megatron-core 0.16.1 before.
        """
        if self.kind == NONE:
            return tuple(k for k in MAIN_KEYS if k not in self.config_fields)
        return tuple(k for k in (*DEV_KEYS, *MAIN_KEYS) if k not in self.config_fields)

    @property
    def can_tell_attention(self) -> bool:
        return self.kind != NONE

    def packed_seq_params_fields(self, layout: str) -> dict:
        """Megatron's own ``PackedSeqParams`` fields to set for rows split by ``layout``."""
        return {"cp_partition_mode": layout} if "cp_partition_mode" in self.packed_fields else {}

    def config_fills(self, layout: str, user: Mapping) -> dict:
        """The layout keys to fill into ``override_transformer_config`` (where the user set none)."""
        return {k: layout for k in self.config_keys if user.get(k) is None}

    def explicit_layout(self, user: Mapping | None):
        """The layout the user set explicitly in this API's words (``None``: not set)."""
        values = {k: (user or {}).get(k) for k in self.config_keys if (user or {}).get(k) is not None}
        if len(set(values.values())) > 1:
            raise CPLayoutError(
                f"override_transformer_config sets {values}: the CP layout keys disagree. Set them to one value."
            )
        return next(iter(values.values()), None)

    def config_layout(self, tf_config):
        for key in self.config_keys:
            value = getattr(tf_config, key, None)
            if value is not None:
                return value
        return None

    def check_overrides(self, user: Mapping | None) -> None:
        """A layout key this Megatron does not read is a start-up error naming both spellings."""
        wrong = [k for k in self.foreign_keys if (user or {}).get(k) is not None]
        if wrong:
            raise CPLayoutError(
                f"override_transformer_config sets {', '.join(wrong)}, which the installed Megatron-Core "
                f"({self.describe()}) does not read. Megatron-LM dev reads {'/'.join(DEV_KEYS)}; Megatron-LM main "
                f"reads {' / '.join(MAIN_KEYS)}. Use the key of the installed one"
                + (f" ({', '.join(self.config_keys)})" if self.config_keys else " (it has neither: remove the key)")
                + "."
            )

    def describe(self) -> str:
        if self.kind == DEV:
            return "Megatron-LM dev CP layout API (PackedSeqParams / TransformerConfig .cp_partition_mode)"
        if self.kind == MAIN:
            return (f"Megatron-LM main CP layout API (TransformerConfig.{' / '.join(MAIN_KEYS)}, "
                    f"PackedSeqParams.{MAIN_ROUTE_FIELD})")  # fmt: skip
        return ("no CP layout API (neither PackedSeqParams.cp_partition_mode nor TransformerConfig."
                "attention_cp_layout): only self-describing attention modules can run contiguous CP")  # fmt: skip


def probe(packed_seq_params_cls, transformer_config_cls) -> CPLayoutAPI:
    """Classify a ``PackedSeqParams`` / ``TransformerConfig`` pair by their dataclass fields."""
    packed, config = _fields(packed_seq_params_cls), _fields(transformer_config_cls)
    if "attention_cp_layout" in config and MAIN_ROUTE_FIELD in packed:
        kind = MAIN
    elif "cp_partition_mode" in packed and "cp_partition_mode" in config:
        kind = DEV
    else:
        kind = NONE
    return CPLayoutAPI(kind, packed, config)


@functools.lru_cache(maxsize=1)
def installed_api() -> CPLayoutAPI:
    """The installed Megatron-Core's API (probed once per process)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    return probe(PackedSeqParams, TransformerConfig)
