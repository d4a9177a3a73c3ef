"""verl plugin: make ``strategy=megatron`` use verl-ds4's engines in every process.

verl imports every ``verl.plugins`` entry point on ``import verl`` (Ray workers included) and
swallows import errors at DEBUG level. This module is that entry point
(``pyproject.toml``: ``[project.entry-points."verl.plugins"] verl_ds4 = "verl_ds4.engine.plugin"``).
Importing it is cheap: it does not import Megatron. It arranges for :func:`register_engines` to run
right after verl's own Megatron engine module (``verl.workers.engine.megatron.transformer_impl``)
has been imported, i.e. in exactly the processes that can build a Megatron engine, and logs one
line when it did. A failure is logged at ERROR with its traceback, never swallowed;
:func:`self_check` raises it again for ``verl-ds4 doctor`` and tests.

Registration uses verl's vendor-keyed registry: ``EngineRegistry.register(model_type=...,
backend="megatron", device="cuda", vendor="nvidia")``. verl looks up ``(device, vendor)`` before
its built-in ``device`` entry, so on NVIDIA GPUs ``strategy=megatron`` resolves to ours while the
strategy name, router replay and checkpoint code stay verl's.

Undo: :func:`unregister_engines` removes the registrations and verl-ds4's hooks on verl's call
sites; :func:`deactivate` also stops waiting for verl's engine module. Both are idempotent.

Environment:
    VERL_DS4_DISABLE_ENGINE=1   load the plugin but register nothing (verl's stock engines stay).
    VERL_DS4_LOG_LEVEL          level of the ``verl_ds4`` loggers (default INFO).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import logging
import os
import sys
import traceback

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
MODEL_TYPES = ("language_model", "value_model")
BACKEND = "megatron"

_package_logger = logging.getLogger("verl_ds4")
if _package_logger.level == logging.NOTSET:
    _package_logger.setLevel(os.getenv("VERL_DS4_LOG_LEVEL", "INFO").upper())
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PluginState:
    """What the plugin did in this process."""

    loaded: bool = False
    deferred: bool = False
    registered: list = dataclasses.field(default_factory=list)  # (model_type, device, vendor, class path)
    error: str | None = None
    disabled: bool = False
    #: verl's engine module finished importing while verl_ds4.engine.megatron was itself importing
    #: it; that module completes the registration when it has finished.
    pending: bool = False


STATE = PluginState()


def _class_path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _register(registry, model_type: str, engine_cls, *, device: str, vendor: str | None) -> None:
    """Register ``engine_cls`` for one key; idempotent for the same class, loud for a different one."""
    key = (device, vendor) if vendor else device
    existing = registry._engines.get(model_type, {}).get(BACKEND, {}).get(key)
    if existing is engine_cls:
        return
    if existing is not None:
        raise RuntimeError(
            f"verl-ds4: EngineRegistry already maps ({model_type!r}, {BACKEND!r}, {key!r}) to "
            f"{_class_path(existing)}; refusing to replace it with {_class_path(engine_cls)}. "
            "Uninstall the other plugin or set VERL_DS4_DISABLE_ENGINE=1."
        )
    registry.register(model_type=model_type, backend=BACKEND, device=device, vendor=vendor)(engine_cls)
    STATE.registered.append((model_type, device, vendor, _class_path(engine_cls)))


def register_engines() -> list[tuple]:
    """Register verl-ds4's Megatron engines with verl's ``EngineRegistry`` (idempotent).

    Also installs the hooks that route verl's copies of the CP layout rule through the resolved
    layout (:func:`verl_ds4.engine.megatron.install_verl_hooks`). Returns what is registered.
    Extend this function with further registrations (e.g. ``device="cpu"``) by calling
    :func:`_register` with the same registry.
    """
    from verl.workers.engine.base import EngineRegistry

    from verl_ds4.engine.megatron import (
        DS4MegatronEngineWithLMHead,
        DS4MegatronEngineWithValueHead,
        install_verl_hooks,
    )

    install_verl_hooks(defer_unresolved=True)  # verl may still be importing: the rest at engine construction
    _register(EngineRegistry, "language_model", DS4MegatronEngineWithLMHead, device="cuda", vendor="nvidia")
    _register(EngineRegistry, "value_model", DS4MegatronEngineWithValueHead, device="cuda", vendor="nvidia")
    return list(STATE.registered)


def unregister_engines() -> list[tuple]:
    """Undo :func:`register_engines`: remove our entries from verl's ``EngineRegistry`` and put verl's
    hooked call sites back (:func:`verl_ds4.engine.megatron.uninstall_verl_hooks`).

    Only entries that still map to our classes are removed (``_register`` never replaced another
    class, so nothing of verl's is lost). Returns what was removed. A later :func:`register_engines`
    registers again.
    """
    from verl.workers.engine.base import EngineRegistry

    from verl_ds4.engine.megatron import uninstall_verl_hooks

    removed = []
    for entry in list(STATE.registered):
        model_type, device, vendor, path = entry
        key = (device, vendor) if vendor else device
        by_key = EngineRegistry._engines.get(model_type, {}).get(BACKEND, {})
        found = by_key.get(key)
        if found is not None and _class_path(found) == path:
            del by_key[key]
            removed.append(entry)
        STATE.registered.remove(entry)
    uninstall_verl_hooks()
    return removed


def deactivate() -> None:
    """Undo :func:`_activate`: stop waiting for verl's engine module and unregister what was registered."""
    for finder in [f for f in sys.meta_path if isinstance(f, _AfterImportFinder) and f.name == ENGINE_MODULE]:
        sys.meta_path.remove(finder)
    if "verl_ds4.engine.megatron" in sys.modules:  # otherwise nothing was registered or hooked
        unregister_engines()
    STATE.deferred = STATE.pending = False
    STATE.loaded = False


def _register_now() -> None:
    try:
        register_engines()
    except Exception as exc:  # noqa: BLE001 - reported loudly, and again by self_check()
        STATE.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        logger.error(
            "verl-ds4 plugin FAILED to register its Megatron engines; strategy=megatron falls back to verl's "
            "stock engines (wrong CP layout / padding for DeepSeek-V4). Run `verl-ds4 doctor`.\n%s",
            STATE.error,
        )
        return
    STATE.error = None
    logger.info(
        "verl-ds4 plugin loaded: strategy=megatron uses %s",
        ", ".join(f"{path} ({model_type})" for model_type, _, _, path in STATE.registered) or "nothing new",
    )


def _register_when_possible() -> None:
    ours = sys.modules.get("verl_ds4.engine.megatron")
    if ours is not None and getattr(getattr(ours, "__spec__", None), "_initializing", False):
        STATE.pending = True
        return
    _register_now()


def complete_pending_registration() -> None:
    """Called by :mod:`verl_ds4.engine.megatron` once it is importable."""
    if STATE.pending:
        STATE.pending = False
        _register_now()


class _AfterImportLoader(importlib.abc.Loader):
    def __init__(self, loader, callback):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after module ``name`` finished executing."""

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec

        def run_once():
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self.callback()

        spec.loader = _AfterImportLoader(spec.loader, run_once)
        return spec


def _activate() -> None:
    STATE.loaded = True
    if os.getenv("VERL_DS4_DISABLE_ENGINE", "").strip().lower() in ("1", "true", "yes"):
        STATE.disabled = True
        logger.warning("verl-ds4 plugin loaded but disabled by VERL_DS4_DISABLE_ENGINE: verl's stock engines are used")
        return
    if ENGINE_MODULE in sys.modules:
        _register_when_possible()
        return
    if not any(isinstance(f, _AfterImportFinder) and f.name == ENGINE_MODULE for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder(ENGINE_MODULE, _register_when_possible))
    STATE.deferred = True


def self_check() -> PluginState:
    """Raise if the plugin is not active in this process; return its state otherwise.

    Imports verl's Megatron engine module (which triggers a deferred registration) and checks that
    verl's registry maps both model types on ``megatron`` for CUDA/NVIDIA to verl-ds4's engines.
    """
    if not STATE.loaded:
        _activate()
    if STATE.disabled:
        raise RuntimeError("verl-ds4 plugin is disabled by VERL_DS4_DISABLE_ENGINE")
    import importlib

    importlib.import_module(ENGINE_MODULE)
    if STATE.error is None and not STATE.registered:
        _register_now()
    if STATE.error is not None:
        raise RuntimeError(f"verl-ds4 plugin failed to register its engines:\n{STATE.error}")
    from verl.workers.engine.base import EngineRegistry

    from verl_ds4.engine.megatron import DS4MegatronEngineWithLMHead, DS4MegatronEngineWithValueHead

    expected = {"language_model": DS4MegatronEngineWithLMHead, "value_model": DS4MegatronEngineWithValueHead}
    for model_type, cls in expected.items():
        found = EngineRegistry._engines.get(model_type, {}).get(BACKEND, {}).get(("cuda", "nvidia"))
        if found is None or not issubclass(found, cls):
            raise RuntimeError(
                f"verl's EngineRegistry maps ({model_type}, megatron, cuda/nvidia) to "
                f"{_class_path(found) if found else 'nothing'}, not {_class_path(cls)}"
            )
    return STATE


_activate()
