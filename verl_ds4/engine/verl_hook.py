"""One verl call site that verl-ds4 replaces while its hooks are installed (the table and the install /
uninstall functions are :mod:`verl_ds4.engine.megatron`'s)."""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Any, Callable

__all__ = ["Installed", "VerlHook"]


@dataclasses.dataclass(frozen=True)
class VerlHook:
    """One verl module attribute that verl-ds4 replaces while its hooks are installed."""

    label: str  # the key of :func:`hooks_installed`
    # the object holding the attribute, or "module.path:Attr" resolved when the hooks are installed (verl modules
    # that import the plugin's entry point while they initialise: importing them here would be circular)
    module: types.ModuleType | str
    name: str
    make: Callable[[Any], Any]  # verl's original -> our replacement

    @property
    def target(self) -> Any:
        if not isinstance(self.module, str):
            return self.module
        module_name, _, attr = self.module.partition(":")
        owner = importlib.import_module(module_name)
        return getattr(owner, attr) if attr else owner


@dataclasses.dataclass(frozen=True)
class Installed:
    original: Any  # verl's object, restored by uninstall_verl_hooks()
    replacement: Any  # what install_verl_hooks() put there
