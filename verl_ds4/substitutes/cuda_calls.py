"""CUDA-only calls of Megatron-LM ``dev``'s DS4 layers made harmless on a CPU-only torch (for a whole process).

Unlike :mod:`.cuda_literals` (a block-scoped redirect around Megatron's optimizer and DDP calls), these are
process-wide: dev's DS4 calls them while building and in every forward, and a CPU-only torch raises on each.

* ``torch.cuda.current_device()`` -> the CPU device (``deepseek_v4_hybrid_attention.py`` creates
  ``linear_o_group_proj`` on it, ``csa.py`` the compressor's ``ape``, the router and MTP their buffers, the rotary
  embeddings move their tables to it);
* ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``stream(...)``: the alltoall token dispatcher's
  device-to-host stream, and waits on it: on a CPU the work is already done in order, so each is a no-op;
* ``torch.cuda.nvtx`` ranges (mHC, CSA) -> no-ops;
* Megatron's CUDA RNG state get / set (activation checkpointing) -> the CPU generator's state;
* ``torch.compile`` (mHC and attention helpers) -> eager (``torch._dynamo.config.disable``): the same functions,
  run uncompiled.

:func:`install` refuses on a machine where CUDA is available: there the real calls must run.
"""

from __future__ import annotations

import contextlib

import torch

from .patching import Patches

__all__ = ["CPUEvent", "CPUStream", "install"]


class CPUEvent:
    """A CUDA event on the CPU: CPU work runs in order, so the event has always happened."""

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True


class CPUStream:
    """A CUDA stream on the CPU: nothing runs beside the main thread, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or CPUEvent()

    def wait_event(self, event):
        return None

    def wait_stream(self, stream):
        return None

    def synchronize(self):
        return None


class _NoRange(contextlib.nullcontext):
    def __init__(self, *args, **kwargs):
        super().__init__()


def _nothing(*args, **kwargs):
    return None


def install(patches: Patches) -> None:
    """Apply the process-wide CPU stand-ins through ``patches`` (undone by ``patches.undo()``)."""
    if torch.cuda.is_available():
        raise RuntimeError("verl_ds4.substitutes.cuda_calls is for CPU-only processes; this one has CUDA")
    from torch import _dynamo
    from megatron.core.tensor_parallel import random as megatron_random

    cpu = torch.device("cpu")

    def current_device():
        return cpu

    current_device.returns_cpu = True  # cuda_literals_on_cpu keeps it (see there)
    patches.set(torch.cuda, "current_device", current_device)
    patches.set(torch.cuda, "Stream", CPUStream)
    patches.set(torch.cuda, "Event", CPUEvent)
    patches.set(torch.cuda, "current_stream", lambda *a, **k: CPUStream())
    patches.set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    patches.set(torch.cuda.nvtx, "range_push", _nothing)
    patches.set(torch.cuda.nvtx, "range_pop", _nothing)
    patches.set(torch.cuda.nvtx, "range", _NoRange)
    patches.set(megatron_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    patches.set(megatron_random, "_set_cuda_rng_state", _nothing)
    patches.set(_dynamo.config, "disable", True)
