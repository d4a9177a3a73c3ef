"""Module-attribute swaps that can be undone: every substitute is installed through one :class:`Patches`."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Patches"]

_MISSING = object()


class Patches:
    """Records each ``setattr`` it makes, so :meth:`undo` restores the originals in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """``owner.name = value`` (``owner``: an object or a module name); returns the original (or None)."""
        if isinstance(owner, str):
            owner = importlib.import_module(owner)
        original = getattr(owner, name, _MISSING)
        self._undo.append((owner, name, original))
        setattr(owner, name, value)
        return None if original is _MISSING else original

    def undo(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __len__(self) -> int:
        return len(self._undo)
