"""The CPU jobs' progress line: ``[verl-ds4] step N | loss L | T tok/s | elapsed S``."""

from __future__ import annotations

import os

__all__ = ["global_step_of", "progress_line"]


def progress_line(step: int, loss: float, tokens: int, step_seconds: float, elapsed: float) -> str:
    """``[verl-ds4] step 12 | loss 2.3412 | 1840 tok/s | elapsed 35.2s`` (tokens of the global batch)."""
    rate = tokens / step_seconds if step_seconds > 0 else float("nan")
    return f"[verl-ds4] step {step} | loss {loss:.4f} | {rate:.0f} tok/s | elapsed {elapsed:.1f}s"


def global_step_of(path) -> int | None:
    """N for a verl checkpoint folder ``.../global_step_N``, else None."""
    name = os.path.basename(os.path.normpath(str(path))) if path else ""
    prefix = "global_step_"
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None
