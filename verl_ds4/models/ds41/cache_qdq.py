"""The released V4.1 cache quantise-dequantise steps, with a straight-through gradient.

DeepSeek-V4.1 rounds three attention caches in its forward, per group of ``block`` consecutive
channels with one scale each (a value ``x`` becomes ``round(x / s) * s``):

* ``"fp8"`` (window KV, block 32): ``s`` = the smallest power of two >= ``max(amax, 1e-4) / 448``;
  ``x / s`` clamped to [-448, 448] and rounded to float8 e4m3 (nearest, ties to even);
* ``"mxfp4"`` (indexer queries and keys, block 32): ``s`` = the smallest power of two >=
  ``max(amax, 6 * 2^-126) / 6``; ``x / s`` clamped to [-6, 6] and rounded to FP4 e2m1;
* ``"nvfp4"`` (compressed KV, block 16): ``s = e4m3(max(amax, 6 * 2^-9) / 6)`` (the scale itself
  rounded to float8 e4m3), then e2m1 as above.

FP4 e2m1 has the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; a value between two of them goes to the
nearer, a tie to the one with an even mantissa (0, 1, 2, 4 and 6 have one; 0.5, 1.5, 3 do not).
The scale search works on float32 values (the release's arithmetic); other dtypes are rounded in
float32 and cast back. The backward passes the gradient through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FORMATS", "cache_qdq"]

#: format -> (block size of the released model, scale rule)
FORMATS = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pow2_at_least(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``v`` (``v`` > 0, normal float32)."""
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), torch.where(mantissa == 0.5, exponent - 1, exponent))


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` in [-6, 6] to the nearest signed e2m1 value (ties to an even mantissa)."""
    levels = x.new_tensor(_E2M1)
    mag = x.abs()
    low = (torch.bucketize(mag, levels, right=True) - 1).clamp(0, len(_E2M1) - 2)
    below, above = levels[low], levels[low + 1]
    up = (above - mag < mag - below) | ((above - mag == mag - below) & (low % 2 == 1))
    return torch.copysign(torch.where(up, above, below), x)


def _qdq(values: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    channels = values.shape[-1]
    groups = F.pad(values.float(), (0, -channels % block)).unflatten(-1, (-1, block))
    amax = groups.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = _pow2_at_least(amax.clamp_min(1e-4) / 448)
        rounded = (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    elif fmt in ("mxfp4", "nvfp4"):
        if fmt == "mxfp4":
            scale = _pow2_at_least(amax.clamp_min(6 * 2**-126) / 6)
        else:
            scale = (amax.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
        rounded = _round_e2m1((groups / scale).clamp(-6, 6))
    else:
        raise ValueError(f"cache QDQ format must be one of {sorted(FORMATS)}, got {fmt!r}.")
    return (rounded * scale).flatten(-2)[..., :channels].to(values.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
        return _qdq(values, fmt, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def cache_qdq(values: torch.Tensor, fmt: str, block: int | None = None) -> torch.Tensor:
    """``values`` ``[..., channels]`` rounded as the released cache ``fmt`` (block: the format's own
    unless given); straight-through gradient."""
    if fmt not in FORMATS:
        raise ValueError(f"cache QDQ format must be one of {sorted(FORMATS)}, got {fmt!r}.")
    return _StraightThrough.apply(values, fmt, FORMATS[fmt] if block is None else int(block))
