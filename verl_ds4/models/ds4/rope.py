"""Rotary position embedding as DeepSeek-V4 uses it.

Conventions (checked against ``transformers.models.deepseek_v4`` and Megatron-LM's DS4 code):

* Partial RoPE on the **last** ``rope_dim`` channels of each head (``[nope | rope]`` layout).
* Interleaved pairs: channels ``(2i, 2i+1)`` of the rope slice rotate together by angle
  ``position * inv_freq[i]`` (not the "rotate half" split layout).
* Sliding-window layers (ratio 0) use plain RoPE with ``rope_theta``; compressed layers (ratio > 1)
  use YaRN frequencies built from ``compress_rope_theta`` with attention scaling (mscale) 1.
* The attention output's rope slice is rotated back by ``-position`` of the query (K = V carries RoPE).

Frequencies and angles are computed in float64 and only then cast to the activation dtype, so an
fp64 model is exact to fp64 rounding.
"""

from __future__ import annotations

import math

import torch

__all__ = ["default_inv_freq", "yarn_inv_freq", "rope_cos_sin", "apply_interleaved_rope"]


def default_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies, float64, shape ``[rope_dim // 2]``."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}.")
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    return 1.0 / (float(theta) ** exponents)


def yarn_inv_freq(
    rope_dim: int,
    theta: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN ("NTK-by-parts", Peng et al. 2023) inverse frequencies, float64, ``[rope_dim // 2]``.

    Frequency pairs that rotate more than ``beta_fast`` times over the original context keep their
    extrapolated frequency, pairs that rotate fewer than ``beta_slow`` times are interpolated by
    ``1 / factor``, and a linear ramp blends the pairs in between. DS4 applies no mscale to cos/sin.
    """
    base = default_inv_freq(rope_dim, theta)
    if factor is None or factor == 1.0:
        return base
    interpolated = base / float(factor)

    def pair_index_for(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times into the original context.
        return rope_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index_for(beta_fast), pair_index_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high = high + 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    return base * (1.0 - ramp) + interpolated * ramp


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables ``[*positions.shape, rope_dim // 2]`` computed in float64, cast to ``dtype``."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float64)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` in interleaved pairs.

    ``cos`` / ``sin`` must broadcast against ``x[..., :rope_dim // 2]`` (add singleton head axes
    yourself). Pass ``-sin`` for the inverse rotation.
    """
    rope_dim = 2 * cos.shape[-1]
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)
