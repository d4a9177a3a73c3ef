"""Typed context-parallel (CP) layouts.

A layout says which rows of the packed THD buffer each CP rank owns:

* ``zigzag``: every sequence is padded to a multiple of ``2 * tp * cp`` and cut into ``2 * cp``
  equal chunks; rank ``r`` owns chunks ``r`` and ``2 * cp - 1 - r`` of *every* sequence.
  This balances dense causal attention and is what TransformerEngine's THD CP consumes.
* ``contiguous``: the packed, padded global buffer of ``T_pad`` rows is cut into ``cp`` equal
  intervals; rank ``r`` owns rows ``[r * L, (r + 1) * L)`` with ``L = T_pad / cp``. Sequences may
  straddle rank boundaries. DeepSeek-V4 attention requires this layout.
"""

from __future__ import annotations

import enum


class CPLayout(str, enum.Enum):
    """The CP layout of a packed THD buffer. Compares equal to its string value."""

    ZIGZAG = "zigzag"
    CONTIGUOUS = "contiguous"

    def __str__(self) -> str:  # "zigzag", not "CPLayout.ZIGZAG", in messages and configs
        return self.value

    @classmethod
    def parse(cls, value: "CPLayout | str") -> "CPLayout":
        """Return the layout named by ``value``; raise ``ValueError`` naming the valid ones."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"Unknown context-parallel layout {value!r}; expected one of {valid}.")

    def sequence_alignment(self, tp_size: int, cp_size: int) -> int:
        """Rows each sequence's padded length must be a multiple of (verl 0.9.1's rule).

        zigzag with CP > 1 cuts each sequence into ``2 * cp`` chunks whose length must be a multiple
        of ``tp`` (sequence parallelism), hence ``2 * tp * cp``; otherwise ``tp * cp``.
        """
        factor = 2 if self is CPLayout.ZIGZAG and cp_size > 1 else 1
        return tp_size * cp_size * factor
