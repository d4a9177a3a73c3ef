"""Where a DS4 / V4.1 model creates its tensors: the device its Megatron config names.

Megatron-Core's rule, read from the ``TransformerConfig``: ``init_model_with_meta_device=True`` (or an
enclosing ``with torch.device("meta")``) -> ``meta``; else ``use_cpu_initialization=True`` -> the CPU; else the current CUDA device
(``torch.cuda.current_device()``, set per rank with ``torch.cuda.set_device``). :func:`config_device`
reads it; :func:`building_on` is the context every model constructor of this package builds under, so
that every parameter and buffer (mHC, norms, MTP, the drafter's modules, which create their tensors
without a device argument) lands there, and Megatron's own layers of ``GPTModel`` (embedding, output
layer) too: with CPU initialisation off they would allocate on ``torch.cuda.current_device()`` and
initialise through Megatron's CUDA RNG tracker, so :func:`megatron_layers_on` builds them through
Megatron's CPU-initialisation path under the same device context (the weights are overwritten by
:func:`~verl_ds4.models.ds4.model.init_ds4_weights` anyway).

``device`` arguments (``build_ds4_model(..., device=...)``) are turned into those two fields by
:func:`device_overrides`.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["config_device", "building_on", "megatron_layers_on", "device_overrides", "device_fields", "resolve_device"]


def resolve_device(device) -> torch.device:
    """``None`` / ``"cpu"`` / ``"cuda"`` / ``"cuda:1"`` / ``"meta"`` / a ``torch.device`` -> a ``torch.device``
    (``cuda`` without an index: the current CUDA device)."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device={device!r}: the DS4 / V4.1 models are built on 'cpu', 'cuda[:N]' or 'meta'.")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def config_device(config) -> torch.device:
    """The device a model built from ``config`` (a Megatron ``TransformerConfig``) creates its tensors on.

    A build inside ``with torch.device("meta")`` (PyTorch's idiom for counting a model without memory)
    stays on ``meta`` whatever the config says: a full-size model is never allocated by surprise."""
    if getattr(config, "init_model_with_meta_device", False) or torch.get_default_device().type == "meta":
        return torch.device("meta")
    if getattr(config, "use_cpu_initialization", True):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def device_overrides(device) -> dict:
    """The ``TransformerConfig`` fields that name ``device`` (see the module doc)."""
    dev = resolve_device(device)
    return {"use_cpu_initialization": dev.type == "cpu", "init_model_with_meta_device": dev.type == "meta"}


def device_fields(device, overrides=None) -> dict:
    """:func:`device_overrides` for an explicit ``device`` merged with ``overrides`` (other config fields). A
    field both set differently is refused: ``device="cuda"`` with ``use_cpu_initialization=True`` would build
    on the CPU without a word. ``device=None`` leaves the placement to ``overrides`` (and the config's default)."""
    overrides = dict(overrides or {})
    if device is None:
        return overrides
    fields = device_overrides(device)
    for key, value in overrides.items():
        if key in fields and bool(value) != fields[key]:
            raise ValueError(f"config_overrides[{key!r}]={value!r} contradicts device={str(device)!r}, which needs "
                             f"{key}={fields[key]}. Fix: drop {key} from config_overrides (device= names where the model "
                             "is built).")  # error-catalogue: internal: a Python API argument pair, not a recipe setting
    return {**fields, **overrides}


@contextlib.contextmanager
def building_on(config):
    """Create the tensors of the modules built inside on ``config``'s device (a ``torch.device`` context)."""
    with torch.device(config_device(config)):
        yield


@contextlib.contextmanager
def megatron_layers_on(config):
    """Build ``GPTModel``'s own layers on ``config``'s device: Megatron's CPU-initialisation code path (no
    ``torch.cuda.current_device()``, no CUDA RNG tracker) under that device's context."""
    dev = config_device(config)
    saved = config.use_cpu_initialization
    config.use_cpu_initialization = True
    try:
        with torch.device(dev):
            yield
    finally:
        config.use_cpu_initialization = saved
