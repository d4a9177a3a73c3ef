"""Weight export from the CPU Megatron engine to the ``cpu_demo`` rollout.

verl's trainer syncs weights with ``engine.get_per_tensor_param()``, which on the Megatron engine
goes through a Megatron bridge (HF names). The CPU engine (:mod:`verl_ds4.cpu.engine`) has no
bridge: its models come from local CPU builders. The ``cpu_demo`` rollout rebuilds the same model
with the same builder (:class:`verl_ds4.rollout.policy.MegatronCPUPolicy`), so the export it needs
is simply the actor module's parameters under their Megatron names: :func:`megatron_named_tensors`.

:func:`install` gives the CPU engines that export **only if they do not define one themselves**
(the method would then belong in ``verl_ds4/cpu/engine.py``; this module steps aside when it is
there). Loading this module installs it when ``VERL_PLATFORM=cpu`` (the CPU PPO launcher lists it
in ``VERL_USE_EXTERNAL_MODULES``). Limits: TP = PP = 1 (every rank holds whole tensors, which is
what the CPU engine supports), no LoRA.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

__all__ = ["install", "megatron_named_tensors"]


def megatron_named_tensors(module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter of a Megatron model (list of chunks or one module), unwrapped.

    Names are those of the bare ``GPTModel`` (wrapper prefixes such as DDP's ``module.`` removed).
    """
    chunks = module if isinstance(module, (list, tuple)) else [module]
    if len(chunks) != 1:
        raise ValueError(
            f"The CPU weight export handles one model chunk (no pipeline/virtual pipeline parallelism); got {len(chunks)}."
        )
    model = chunks[0]
    # Megatron's wrappers (DistributedDataParallel, Float16Module) hold the model in `.module`.
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    for name, param in model.named_parameters():
        yield name, param.detach()


def _get_per_tensor_param(self, base_sync_done: bool = False, **kwargs):
    """The CPU engine's export for the ``cpu_demo`` rollout: Megatron names, whole tensors, no PEFT."""
    from megatron.core import parallel_state as mpu

    if getattr(self, "peft_cls", None) is not None:
        raise ValueError("The CPU weight export does not support LoRA/PEFT.")
    if mpu.get_tensor_model_parallel_world_size() != 1 or mpu.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("The CPU weight export needs tensor and pipeline parallel size 1 (whole tensors on every rank).")
    return megatron_named_tensors(self.module), None


_INSTALLED: list[type] = []


def install() -> list[str]:
    """Give the CPU engines :func:`_get_per_tensor_param` unless they define their own; returns the classes patched."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from verl_ds4.cpu import engine as cpu_engine

    patched = []
    for cls in (cpu_engine.CPUMegatronEngineWithLMHead, cpu_engine.CPUMegatronEngineWithValueHead):
        if cls.get_per_tensor_param is not MegatronEngine.get_per_tensor_param:
            continue  # the engine (or a base between it and verl's) has its own export
        cls.get_per_tensor_param = _get_per_tensor_param
        patched.append(f"{cls.__module__}.{cls.__qualname__}")
        _INSTALLED.append(cls)
    if patched:
        logger.info("verl-ds4: CPU weight export for the cpu_demo rollout installed on %s", ", ".join(patched))
    return patched


def uninstall() -> list[str]:
    """Take :func:`install` back: the CPU engines export through verl's method again; returns the classes restored."""
    restored = []
    while _INSTALLED:
        cls = _INSTALLED.pop()
        if cls.__dict__.get("get_per_tensor_param") is _get_per_tensor_param:
            del cls.get_per_tensor_param
            restored.append(f"{cls.__module__}.{cls.__qualname__}")
    return restored


if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    install()
