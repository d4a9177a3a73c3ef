"""A CPU platform for verl 0.9.1 (``VERL_PLATFORM=cpu``).

verl resolves its device through :mod:`verl.plugin.platform`; 0.9.1 ships CUDA, NPU and
ROCm platforms only. This module registers a ``cpu`` platform with verl's own registry and,
when the CPU platform is the selected one, replaces the two process-group initialisers of
:mod:`verl.utils.distributed` whose backend string is ``"cpu:gloo,<device>:<backend>"`` -
with device ``cpu`` that string names the CPU twice and ``init_process_group`` rejects it.

How it is loaded (either works; both are idempotent):

* ``VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform`` - verl imports it at ``import verl``
  in every process (torchrun workers, Ray workers);
* :func:`install` called explicitly (the verl-ds4 plugin calls it when ``VERL_PLATFORM=cpu``).

Nothing here changes behaviour unless ``VERL_PLATFORM=cpu``: registering a platform name
does not select it, and the process-group replacements are only installed for the CPU
platform. The GPU path never sees this module's effects.

Platform facts (what verl's call sites get on CPU):

=====================  ==========================================================
``device_name``        ``"cpu"`` (tensors go to ``"cpu"``; ``trainer.device=cpu``)
``current_device()``   ``"cpu"`` (verl uses it as a ``.to()`` target)
``device_count()``     ``0``: Megatron's CUDA RNG seeding and other per-GPU code skip
backend                ``gloo``
``device_module``      a small namespace: ``torch.cpu`` plus no-op memory/cache/sync
                       calls and RNG calls that act on the CPU generator
``ray_resource_name``  ``"GPU"``: verl's Ray worker groups hard-code ``use_gpu=True``;
                       a CPU run gives Ray logical GPUs (``ray_init.num_gpus``)
=====================  ==========================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
from datetime import timedelta
from typing import Any, Optional

import torch

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

logger = logging.getLogger(__name__)

PLATFORM_NAME = "cpu"
ENV_PLATFORM = "VERL_PLATFORM"


def cpu_platform_selected() -> bool:
    """True when the user selected this platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get(ENV_PLATFORM, "").strip().lower() == PLATFORM_NAME


def _zero(*_args, **_kwargs) -> int:
    return 0


def _noop(*_args, **_kwargs) -> None:
    return None


def _mem_get_info(*_args, **_kwargs) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _make_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module.

    Memory statistics report 0 (the CPU allocator keeps none), cache and IPC calls do
    nothing, RNG calls act on torch's CPU generator. Anything else falls through to
    ``torch.cpu`` so a missing call fails with an AttributeError naming it.
    """
    mod = types.ModuleType("verl_ds4_cpu_device")
    mod.__doc__ = "CPU device module for verl's platform API (see verl_ds4.cpu.platform)."
    overrides: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": _zero,
        "current_device": lambda: "cpu",
        "set_device": _noop,
        "synchronize": _noop,
        "empty_cache": _noop,
        "ipc_collect": _noop,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "reset_peak_memory_stats": _noop,
        "set_per_process_memory_fraction": _noop,
        "mem_get_info": _mem_get_info,
        "get_device_name": lambda *_a, **_k: "cpu",
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
        "get_rng_state": lambda *_a, **_k: torch.get_rng_state(),
        "set_rng_state": lambda state, *_a, **_k: torch.set_rng_state(state),
    }
    for name, value in overrides.items():
        setattr(mod, name, value)

    def __getattr__(name: str):  # noqa: N807 - module-level getattr protocol
        return getattr(torch.cpu, name)

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return mod


_DEVICE_MODULE = _make_device_module()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for plain CPUs (gloo collectives, no accelerator)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a CPU run is always an explicit choice (VERL_PLATFORM=cpu),
        # so a GPU host without a visible GPU in some process never silently lands here.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 0

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Nothing to hide on a CPU; CUDA's name keeps Ray's env handling a no-op here.
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


# ---------------------------------------------------------------------------------------
# Process-group initialisation (verl.utils.distributed), CPU platform only
# ---------------------------------------------------------------------------------------


def initialize_global_process_group_cpu(timeout_second: int = 36000):
    """CPU twin of ``verl.utils.distributed.initialize_global_process_group``: gloo only.

    Same contract as verl's: reads ``LOCAL_RANK``/``RANK``/``WORLD_SIZE`` (torchrun sets
    them), honours ``DIST_INIT_METHOD``, returns ``(local_rank, rank, world_size)``.
    """
    missing = [k for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"initialize_global_process_group needs the torchrun environment; {missing} not set. "
            "Launch with `torchrun --nproc_per_node=N -m verl.trainer.sft_trainer ...`."
        )
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
    return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def initialize_global_process_group_ray_cpu(timeout_second=None, backend=None):
    """CPU twin of ``verl.utils.distributed.initialize_global_process_group_ray``.

    An explicit ``backend`` from the caller is honoured as given; the default is gloo.
    """
    if torch.distributed.is_initialized():
        return
    timeout = timedelta(seconds=timeout_second) if timeout_second is not None else None
    torch.distributed.init_process_group(
        backend=backend or "gloo",
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        timeout=timeout,
        init_method=os.environ.get("DIST_INIT_METHOD", None),
    )


_REPLACEMENTS = {
    "initialize_global_process_group": initialize_global_process_group_cpu,
    "initialize_global_process_group_ray": initialize_global_process_group_ray_cpu,
}

# Modules that bind these names with `from verl.utils.distributed import ...` at import
# time; if one was imported before install(), its binding is replaced too.
_BINDING_MODULES = ("verl.workers.engine_workers",)


#: While installed: (module name, attribute) -> verl's original object there, restored by uninstall().
_ORIGINALS: dict[tuple[str, str], Any] = {}


def _binding_sites():
    """``(module, attribute, replacement)`` of every name :func:`install` replaces in this process."""
    import sys

    import verl.utils.distributed as verl_dist

    for name, fn in _REPLACEMENTS.items():
        yield verl_dist, name, fn
        for mod_name in _BINDING_MODULES:
            mod = sys.modules.get(mod_name)
            if mod is not None and hasattr(mod, name):
                yield mod, name, fn


def install() -> bool:
    """Make the CPU platform effective in this process if ``VERL_PLATFORM=cpu``.

    Returns True when installed. Idempotent (verl's originals are kept once, for :func:`uninstall`).
    With any other platform it does nothing and returns False (the platform stays registered but
    unselected).
    """
    if not cpu_platform_selected():
        return False
    for module, name, fn in _binding_sites():
        key = (module.__name__, name)
        current = getattr(module, name)
        if current is not fn and key not in _ORIGINALS:
            _ORIGINALS[key] = current
        setattr(module, name, fn)
    return True


def uninstall() -> bool:
    """Put verl's process-group initialisers back where :func:`install` replaced them (idempotent).

    Returns True when something was restored. A name someone else replaced after :func:`install`
    is left alone.
    """
    import sys

    restored = False
    verl_originals = {name: _ORIGINALS.get(("verl.utils.distributed", name)) for name in _REPLACEMENTS}
    for mod_name in _BINDING_MODULES:  # bound `from verl.utils.distributed import ...` after install()
        for name, original in verl_originals.items():
            key = (mod_name, name)
            module = sys.modules.get(mod_name)
            if original is not None and key not in _ORIGINALS and getattr(module, name, None) is _REPLACEMENTS[name]:
                _ORIGINALS[key] = original
    for (mod_name, name), original in list(_ORIGINALS.items()):
        module = sys.modules.get(mod_name)
        if module is not None and getattr(module, name, None) is _REPLACEMENTS[name]:
            setattr(module, name, original)
            restored = True
        del _ORIGINALS[(mod_name, name)]
    return restored


def installed() -> bool:
    """Whether verl's process-group initialisers are the CPU twins now."""
    import verl.utils.distributed as verl_dist

    return verl_dist.initialize_global_process_group is initialize_global_process_group_cpu


def self_check() -> None:
    """Raise with a clear message if ``VERL_PLATFORM=cpu`` is set but not effective."""
    from verl.plugin.platform import get_platform

    import verl.utils.distributed as verl_dist

    if not cpu_platform_selected():
        raise RuntimeError(f"{ENV_PLATFORM}={os.environ.get(ENV_PLATFORM)!r}: the CPU platform is not selected.")
    platform = get_platform()
    if not isinstance(platform, PlatformCPU):
        raise RuntimeError(
            f"VERL_PLATFORM=cpu but verl's platform is {type(platform).__name__}: verl resolved its platform "
            "before verl_ds4.cpu.platform was imported. Set VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform."
        )
    if verl_dist.initialize_global_process_group is not initialize_global_process_group_cpu:
        raise RuntimeError("verl_ds4.cpu.platform.install() did not run: verl would initialise nccl on CPU.")  # error-catalogue: internal: the platform module's install step was skipped by code


install()
