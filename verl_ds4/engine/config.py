"""verl-ds4's Megatron engine config: verl's ``McoreEngineConfig`` plus the settings it owns.

``DS4McoreEngineConfig`` adds one field to verl 0.9.1's config and keeps every other field and
check of verl's. Select it in a Hydra config with ``_target_: verl_ds4.engine.config.
DS4McoreEngineConfig`` (the DS4 recipes do; see ``recipes/recipe/``); engines built from verl's
own config read the defaults below.

* ``cp_balance``: ``null`` (default: sequences stay in batch order in the packed buffer) or the
  name of a per-token cost model (``ds4`` or ``dense``, :mod:`verl_ds4.layout.cost`): with the
  contiguous CP layout, the order of sequences in the buffer is chosen to minimise the most
  loaded CP rank's cost (:mod:`verl_ds4.layout.balance`); outputs come back in batch order. Off
  by default until measured on GPUs. A zigzag layout with ``cp_balance`` set is refused when the
  engine resolves its layout (start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from verl.workers.config import McoreEngineConfig

from verl_ds4.layout.cost import COST_MODELS

__all__ = ["CP_BALANCE_CHOICES", "DS4McoreEngineConfig", "cp_balance_of"]

CP_BALANCE_CHOICES = tuple(COST_MODELS)  # the cost models PlanOptions.balance accepts


def _check_cp_balance(value) -> Optional[str]:
    if value is None:
        return None
    if value not in CP_BALANCE_CHOICES:
        raise ValueError(
            f"engine cp_balance={value!r}: expected null (batch order) or a cost model name, one of "
            f"{list(CP_BALANCE_CHOICES)} (recipe knob ds4.cp_balance)."
        )
    return value


@dataclass
class DS4McoreEngineConfig(McoreEngineConfig):
    """verl's ``McoreEngineConfig`` plus ``cp_balance`` (see the module docstring)."""

    cp_balance: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_cp_balance(self.cp_balance)


def cp_balance_of(engine_config) -> Optional[str]:
    """The ``cp_balance`` of any engine config (verl's own has none: ``None``), checked."""
    return _check_cp_balance(getattr(engine_config, "cp_balance", None))
