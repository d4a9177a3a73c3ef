"""The rows of a parity table and the differences they hold (``verl-ds4 verify``'s DS4 and V4.1 harnesses).

:class:`Row` is one line (a quantity, its max abs / max rel difference, the bound and what is expected);
:func:`max_diff` compares two arrays, :func:`group_diff` a group of parameters' gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Row", "group_diff", "max_diff", "rows_passed"]


@dataclass
class Row:
    """One line of the parity table.

    ``expect="match"``: passes when ``max_rel <= tol``. ``expect="differ"``: a negative control that
    passes when ``max_rel > tol`` (the harness must be able to see a broken layout).
    ``expect="error"``: passes when the expected error was raised (diffs are 0 then, inf otherwise).
    ``expect="absent"``: a quantity the model does not have (the row says why); nothing is compared.
    """

    quantity: str
    max_abs: float
    max_rel: float
    tol: float
    expect: str = "match"

    @property
    def passed(self) -> bool:
        if self.expect == "absent":
            return True
        if not math.isfinite(self.max_rel):
            return False
        return self.max_rel > self.tol if self.expect == "differ" else self.max_rel <= self.tol


def max_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a - b|, that / max |b|); inf for different shapes."""
    if a.shape != b.shape:
        return math.inf, math.inf
    abs_diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    rel = abs_diff / scale if scale > 0 else (0.0 if abs_diff == 0 else math.inf)
    return abs_diff, rel


def group_diff(a: dict, b: dict) -> tuple[float, float, int, int]:
    """Max abs diff over a group's parameters and rel = that / the group's max |gradient| (a parameter
    whose gradient nearly cancels, e.g. an mHC bias of 1e-11 beside others of 1e-3, would otherwise
    turn fp64 round-off into a large ratio); counts of compared and grad-less parameters."""
    if set(a) != set(b):
        return math.inf, math.inf, 0, 0
    worst_abs = scale = 0.0
    compared = without = 0
    for name in a:
        if (a[name] is None) != (b[name] is None):
            return math.inf, math.inf, compared, without
        if a[name] is None:
            without += 1
            continue
        if a[name].shape != b[name].shape:
            return math.inf, math.inf, compared, without
        d_abs, _ = max_diff(a[name], b[name])
        worst_abs = max(worst_abs, d_abs)
        scale = max(scale, float(np.max(np.abs(b[name]))) if b[name].size else 0.0)
        compared += 1
    rel = worst_abs / scale if scale > 0 else (0.0 if worst_abs == 0 else math.inf)
    return worst_abs, rel, compared, without


def rows_passed(rows: list[Row]) -> bool:
    return all(row.passed for row in rows)
