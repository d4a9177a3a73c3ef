"""The indexer's Hadamard rotation in any dtype on any device (``dsa.rotate_activation``'s stand-in).

Megatron-LM ``dev``'s ``rotate_activation(x)`` asserts bfloat16 and calls ``fast_hadamard_transform``'s CUDA kernel:
``y = x H / sqrt(d)`` with ``H`` the ``d x d`` Sylvester Hadamard matrix (``d`` a power of two). Here the same map is
a matrix product with the exact +-1 matrix: it saves nothing for backward (``H`` is symmetric, so the backward is
the same map), like the kernel. The proof is ``tests/test_production_path_on_cpu.py`` (the closed form ``H H = d I``
and equality with ``fast_hadamard_transform`` where it is importable).
"""

from __future__ import annotations

import torch

__all__ = ["hadamard_matrix", "rotate_activation"]

_CACHE: dict[tuple, torch.Tensor] = {}


def hadamard_matrix(d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The ``d x d`` Sylvester Hadamard matrix (entries +-1); ``d`` must be a power of two."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {d} (DS4's index_head_dim is 128)")
    key = (d, dtype, str(device))
    if key not in _CACHE:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _CACHE[key] = h.to(dtype=dtype, device=device)
    return _CACHE[key]


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        return (x @ hadamard_matrix(d, x.dtype, x.device)) * d**-0.5

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        d = grad.shape[-1]
        return (grad @ hadamard_matrix(d, grad.dtype, grad.device)) * d**-0.5


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """``x H / sqrt(d)`` over the last dimension, in ``x``'s dtype."""
    return _Rotate.apply(x)
