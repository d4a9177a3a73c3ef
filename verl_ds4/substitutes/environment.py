"""What the production path needs from its environment, checked before a model is built, and two helpers for loading
weights through Megatron-Bridge on a CPU (used by the proofs in ``verify`` and by the production CPU engine).

* :func:`require_bridge`: Python 3.12 and a Megatron-Bridge with its DeepSeek-V4 bridge;
* :func:`require_megatron_dev`: this process's ``megatron.core`` is Megatron-LM dev's (it has DeepSeek-V4);
* :func:`no_torch_function_mode`: safetensors reinterprets bytes with ``view(dtype)``, so no dtype promotion may be
  active while weights load; :func:`quiet_progress`: Bridge's per-load progress bar off.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["BRIDGE_VERSION", "no_torch_function_mode", "quiet_progress", "require_bridge", "require_megatron_dev"]


#: The Megatron-Bridge release the production path was proven with (lane 2 installs it; the image pins it).
BRIDGE_VERSION = "0.6.2"


def require_bridge() -> None:
    """Refuse, with what to install, a Python or a Megatron-Bridge that cannot build DS4: Bridge needs Python 3.12
    and must have its DeepSeek-V4 bridge (``megatron.bridge.models.deepseek.deepseek_v4_bridge``, from 0.6)."""
    import importlib.util
    import sys

    if sys.version_info[:2] != (3, 12):
        raise RuntimeError(
            f"the production path needs Python 3.12 (Megatron-Bridge {BRIDGE_VERSION} requires it); this is Python "
            f"{sys.version_info[0]}.{sys.version_info[1]}. Use the lane-2 venv (bash scripts/dev.sh test sets up "
            ".venv312) or a Python 3.12 venv with `pip install --no-deps megatron-bridge==0.6.2`.")
    spec = importlib.util.find_spec("megatron.bridge")  # imports the namespace `megatron` only, not the bridge
    if spec is None:
        raise RuntimeError(f"Megatron-Bridge is not installed: `pip install --no-deps megatron-bridge=={BRIDGE_VERSION}` "
                           "and its import-time packages (scripts/dev.sh BRIDGE312_IMPORT_DEPS)")
    roots = [Path(p) for p in spec.submodule_search_locations or ()]
    if not any((r / "models" / "deepseek" / "deepseek_v4_bridge.py").is_file() for r in roots):
        from importlib.metadata import version

        raise RuntimeError(f"Megatron-Bridge {version('megatron-bridge')} has no DeepSeek-V4 bridge "
                           f"(megatron.bridge.models.deepseek.deepseek_v4_bridge); install megatron-bridge=={BRIDGE_VERSION}")


def require_megatron_dev() -> None:
    """Refuse, before any rank starts, a process whose ``megatron.core`` has no DeepSeek-V4 (not Megatron-LM dev)."""
    import importlib.util

    if importlib.util.find_spec("megatron.core.transformer.experimental_attention_variant.deepseek_v4_hybrid_attention") is None:
        from verl_ds4.substitutes.megatron_dev import make_command

        raise RuntimeError(
            "the production engine runs Megatron-LM dev's DeepSeek-V4, and this process's megatron.core has none "
            "(a released megatron-core). Put a dev export first on the path: MEGATRON_DEV_DIR=<export> or "
            f"verl_ds4.substitutes.megatron_dev.use(...); make one with: {make_command()}")


@contextlib.contextmanager
def no_torch_function_mode():
    """Safetensors reinterprets bytes with ``view(dtype)``: no dtype promotion may be active while weights load."""
    from torch.overrides import _pop_mode_temporarily, _len_torch_function_stack

    with contextlib.ExitStack() as stack:
        for _ in range(_len_torch_function_stack()):
            stack.enter_context(_pop_mode_temporarily())
        yield


@contextlib.contextmanager
def quiet_progress():
    """Bridge draws a progress bar per load; the proofs print their own lines."""
    import logging

    level = logging.getLogger("megatron.bridge").level
    logging.getLogger("megatron.bridge").setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger("megatron.bridge").setLevel(level)
