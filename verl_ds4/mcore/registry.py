"""A registry keyed by object identity that holds its keys weakly (for the resolver's layouts).

The resolver records the engine's :class:`~verl_ds4.mcore.resolver.ResolvedCPLayout` per model chunk
and per ``TransformerConfig`` here instead of setting attributes on Megatron's or verl's objects.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["IdentityRegistry"]


class IdentityRegistry:
    """``object -> value`` by identity, holding only weak references to the objects.

    Keyed by ``id`` (a ``TransformerConfig`` is an unhashable dataclass); an entry disappears with
    its object, and an ``id`` reused by a new object never finds the old entry.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def set(self, obj, value: Any) -> None:
        key = id(obj)

        def forget(ref, key=key, entries=self._entries):
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        try:
            ref = weakref.ref(obj, forget)
        except TypeError:
            raise TypeError(
                f"cannot register a {type(obj).__name__}: it cannot be weakly referenced"
            ) from None
        self._entries[key] = (ref, value)

    def get(self, obj) -> Any | None:
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]

    def __len__(self) -> int:
        return len(self._entries)
