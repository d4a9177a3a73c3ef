"""Precision and tie rules that make two DS4 implementations comparable number for number.

* :class:`PromoteFloat32ToFloat64`: Megatron-LM ``dev``'s DS4 (and transformers') compute several steps in float32
  whatever the model dtype (about 40 ``.float()`` casts in ``csa.py`` / ``dsa.py``, mHC's ``.to(torch.float32)``, the
  router, parameters such as the compressor's ``ape`` and the rotary ``inv_freq`` tables created as float32). Inside
  this ``TorchFunctionMode`` every float32 request becomes float64, without an edit to their code: built and run
  inside it (:func:`fp64_reference`), a model is a true float64 computation. This is the one place where Megatron's
  hard float32 casts are neutralised for the float64 proofs.
* :class:`StableTopK`: ``torch.topk`` leaves the order of equal values unspecified; the indexer's ReLU scores of a
  tiny model have exact ties (zeros), so two correct implementations can pick different blocks. Inside this mode
  ``topk`` takes equal values in index order, the tie rule of verl-ds4's own model, applied to both sides of a
  comparison.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PromoteFloat32ToFloat64", "StableTopK", "float_keeps_float64", "fp64_reference", "install_stable_topk", "stable_topk"]


class PromoteFloat32ToFloat64(TorchFunctionMode):
    """Inside this mode, ``Tensor.float()``, ``.to(torch.float32)`` and ``dtype=torch.float32`` arguments
    produce float64 instead. Use together with ``torch.set_default_dtype(torch.float64)``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func is torch.Tensor.to:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


class StableTopK(TorchFunctionMode):
    """Inside this mode ``torch.topk`` / ``Tensor.topk`` take equal values in index order (lowest index
    first), as ``torch.sort(..., stable=True)`` orders them: the DS4 tie rule of our indexer and router
    (:mod:`.moe`), applied to the reference in tests. ``largest=False`` sorts ascending, also stably."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.topk or func is torch.Tensor.topk:
            names = ("input", "k", "dim", "largest", "sorted")
            bound = dict(zip(names, args))
            bound.update(kwargs)
            dim, largest = bound.get("dim", -1), bound.get("largest", True)
            order = torch.sort(bound["input"], dim=dim, descending=largest, stable=True)
            index = torch.arange(bound["k"], device=order.indices.device)
            values, indices = order.values.index_select(dim, index), order.indices.index_select(dim, index)
            return torch.return_types.topk((values, indices))
        return func(*args, **kwargs)


def stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    """``torch.topk`` with equal values taken in index order (``torch.sort(..., stable=True)``); same values and,
    where the scores differ, the same indices as ``torch.topk``."""
    if out is not None:
        raise TypeError("stable_topk does not take out=")  # error-catalogue: internal (no caller in Megatron passes out=)
    order = torch.sort(input, dim=dim, descending=largest, stable=True)
    index = torch.arange(k, device=order.indices.device)
    return torch.return_types.topk((order.values.index_select(dim, index), order.indices.index_select(dim, index)))


def install_stable_topk(patches) -> None:
    """Process-wide :func:`stable_topk` as ``torch.topk`` and ``Tensor.topk`` (through ``patches``): the CPU tie rule of
    the production engine and its rollout, so that CP ranks, CP sizes and the rollout pick the same of equally
    scored keys or experts (a CPU ``torch.topk`` orders ties by its algorithm, which depends on the tensor's shape)."""
    patches.set(torch, "topk", stable_topk)
    patches.set(torch.Tensor, "topk", lambda self, k, dim=-1, largest=True, sorted=True: stable_topk(self, k, dim, largest, sorted))


@contextlib.contextmanager
def fp64_reference(stable_topk: bool = True):
    """fp64 default dtype + :class:`PromoteFloat32ToFloat64` (+ :class:`StableTopK`): transformers' DS4
    as a true fp64 computation with our top-k tie rule."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(PromoteFloat32ToFloat64())
            if stable_topk:
                stack.enter_context(StableTopK())
            yield
    finally:
        torch.set_default_dtype(previous)


def float_keeps_float64(patches) -> None:
    """Process-wide: ``Tensor.float()`` returns a float64 tensor unchanged. Megatron's custom autograd functions cast
    with ``.float()`` in their *backward* (the indexer loss), which the autograd engine runs outside any
    torch-function mode; a float64 proof rank (a process of its own) installs this through ``patches``."""
    original = torch.Tensor.float

    def as_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    patches.set(torch.Tensor, "float", as_float)
