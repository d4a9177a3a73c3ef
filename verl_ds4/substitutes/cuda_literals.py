"""Megatron-Core code that hard-codes CUDA, run on the CPU for the duration of a call.

Megatron-Core creates ``device="cuda"`` scalars in the optimizer (found-inf, grad-norm, clip
buffers), the schedule (``total_num_tokens``) and DDP's grad buffers, asserts
``param.type() == 'torch.cuda.FloatTensor'`` and calls ``torch.cuda.synchronize`` in
dist-checkpointing; megatron-core 0.19's DDP grad sync (``start_grad_sync``) waits on
``torch.cuda.current_stream()``. :func:`cuda_literals_on_cpu` redirects exactly those for the
block; the CPU engines (:mod:`verl_ds4.cpu.engine`) wrap the Megatron calls that need it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cuda_literals_on_cpu"]


def _is_accelerator_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means "cuda:<index>" to torch factory functions
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaLiteralsToCPU(TorchFunctionMode):
    """Torch-function mode: ``device="cuda"``/index arguments become ``"cpu"``.

    Also makes ``tensor.cuda()`` return the CPU tensor itself and, with
    ``report_cuda_types``, ``tensor.type()`` name a CPU float tensor by its CUDA type
    (Megatron's optimizers assert ``param.type() == 'torch.cuda.FloatTensor'``).
    """

    def __init__(self, report_cuda_types: bool):
        super().__init__()
        self.report_cuda_types = report_cuda_types

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_accelerator_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # page-locked host memory needs a CUDA driver; on a CPU it changes nothing
        if func is torch.Tensor.cuda and args and args[0].device.type == "cpu":
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_accelerator_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if self.report_cuda_types and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


class _CPUStream:
    """``torch.cuda.current_stream()`` on the CPU: work is already done in order, nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CPUStream()


@contextlib.contextmanager
def cuda_literals_on_cpu(report_cuda_types: bool = False):
    """Run Megatron-Core code that hard-codes CUDA on the CPU.

    Inside the block: tensors requested on ``"cuda"`` (or a device index) are created on the
    CPU, ``torch.cuda.current_device()`` returns 0 (then mapped to the CPU),
    ``torch.cuda.synchronize()`` does nothing and ``torch.cuda.current_stream()`` is a stream whose
    waits do nothing; ``pin_memory=True`` is dropped. Only the CPU engines use it, around the
    Megatron calls listed in this module's docstring; it is a no-op for code that does not
    name CUDA.
    """
    saved = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "current_stream")}
    if not getattr(torch.cuda.current_device, "returns_cpu", False):
        # 0, mapped to the CPU by the mode below; the production path's substitute (verl_ds4.substitutes.cuda_calls)
        # already returns the CPU device, and is kept: autograd runs backward functions outside this mode, and dev's
        # CP backward allocates on torch.cuda.current_device() (tensor_parallel/mappings.py)
        torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
    try:
        with _CudaLiteralsToCPU(report_cuda_types):
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
