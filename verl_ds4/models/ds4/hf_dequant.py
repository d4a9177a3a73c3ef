"""Dequantise the hub's DeepSeek-V4 tensors on load (the CPU path; Megatron-Bridge does its own on GPU).

    weight = dequantize_fp8_block(w_fp8, scale_e8m0, block=(128, 128))   # float64 [out, in]
    weight = dequantize_fp4(packed_int8, scale_e8m0)                    # float64 [out, 2 * packed cols]
    tensors = dequantize_tensors(read_tensors, fmt)                      # ``X.scale`` consumed, weights exact

Storage (docs/ds4-context-parallel.md section 11), each quantised ``X.weight`` beside ``X.scale``:

* FP8: ``X.weight`` ``float8_e4m3fn`` ``[out, in]``; ``X.scale`` ``[ceil(out / bm), ceil(in / bn)]``
  with ``(bm, bn)`` = ``weight_block_size`` (rows x columns; the last block of a row / column may
  be partial); ``value[i, j] = w[i, j] * scale[i // bm, j // bn]``.
* FP4 (routed experts, ``expert_dtype: fp4``): ``X.weight`` ``int8`` (or ``uint8`` /
  ``float4_e2m1fn_x2``) ``[out, in / 2]``, element ``2j`` in the low nibble of byte ``j`` and
  ``2j + 1`` in the high one; a nibble is E2M1 (bit 3 sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6);
  ``X.scale`` ``[out, in / 32]``, one scale per 32 consecutive inputs.
* Scales are UE8M0 (``float8_e8m0fnu``, or its raw ``uint8`` bytes): byte ``b`` is ``2 ** (b - 127)``;
  ``b = 255`` (NaN) is refused.

Every value is an FP8 / FP4 number times a power of two, so the float64 results are exact, and so is
the bf16 (else float32) copy :func:`dequantize_tensors` returns. Anything else (a quantised tensor
without its scale, a scale grid that does not match the block size, a quantised tensor in a folder
whose config declares no quantisation, a float8 kind the hub does not use) raises
:class:`~.checkpoint_format.CheckpointFormatError` naming the tensor, what was found and what is read.
"""

from __future__ import annotations

import torch

from .checkpoint_format import FP4_GROUP, CheckpointFormat, CheckpointFormatError, check_cpu_readable

__all__ = ["E2M1_MAGNITUDES", "E8M0_BIAS", "e8m0_to_float", "unpack_fp4_e2m1", "fp8_block_shape", "fp4_shape", "dequantize_fp8_block",
           "dequantize_fp4", "dequantize_tensors"]

#: E2M1 magnitudes by the low three bits of a nibble (bit 3 is the sign).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: UE8M0 exponent bias: byte b means 2 ** (b - E8M0_BIAS).
E8M0_BIAS = 127
_FP4_DTYPES = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2") else set())
_FP8 = torch.float8_e4m3fn


def _check_scale_dtype(scale: torch.Tensor, name: str) -> None:
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise CheckpointFormatError(f"tensor {name!r} is {scale.dtype}; expected UE8M0 scales (float8_e8m0fnu or uint8 bytes).")


def e8m0_to_float(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """UE8M0 scales (``float8_e8m0fnu`` or raw ``uint8`` bytes) as float64 powers of two."""
    _check_scale_dtype(scale, name)
    bits = scale.contiguous().view(torch.uint8).to(torch.int64)
    if bool((bits == 255).any()):
        raise CheckpointFormatError(f"tensor {name!r} holds the UE8M0 NaN byte 255; expected finite power-of-two scales.")
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), (bits - E8M0_BIAS).to(torch.float64))


def unpack_fp4_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 values per byte (low nibble first) -> float64, the last dimension doubled."""
    bytes_ = packed.contiguous().view(torch.uint8).to(torch.int64)
    nibbles = torch.stack([bytes_ & 0xF, bytes_ >> 4], dim=-1).flatten(-2)
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[nibbles & 0x7]
    return torch.where(nibbles >= 8, -magnitude, magnitude)


def _grid(n: int, block: int) -> int:
    return -(-n // block)


def fp8_block_shape(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "weight") -> tuple[int, int]:
    """The ``[out, in]`` shape :func:`dequantize_fp8_block` returns, with every rule it checks on dtypes and
    shapes (no value is read: ``meta`` tensors from a safetensors header do)."""
    if weight.dtype != _FP8 or weight.dim() != 2:
        raise CheckpointFormatError(f"tensor {name!r} is {weight.dtype} {tuple(weight.shape)}; expected a 2-D float8_e4m3fn weight.")
    (rows, cols), (bm, bn) = weight.shape, block
    want = (_grid(rows, bm), _grid(cols, bn))
    if tuple(scale.shape) != want:
        raise CheckpointFormatError(
            f"tensor {name!r} {tuple(weight.shape)} has scales {tuple(scale.shape)}; weight_block_size {list(block)} "
            f"needs {want} (ceil(out/{bm}), ceil(in/{bn})). Check weight_block_size in config.json."
        )
    _check_scale_dtype(scale, name)
    return rows, cols


def fp4_shape(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP, name: str = "weight") -> tuple[int, int]:
    """The ``[out, in]`` shape :func:`dequantize_fp4` returns, with its dtype and shape rules (no value read)."""
    if packed.dtype not in _FP4_DTYPES or packed.dim() != 2:
        raise CheckpointFormatError(f"tensor {name!r} is {packed.dtype} {tuple(packed.shape)}; expected 2-D packed FP4 (int8).")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if cols % group or tuple(scale.shape) != (rows, cols // group):
        raise CheckpointFormatError(
            f"tensor {name!r} {tuple(packed.shape)} (FP4, {cols} inputs) has scales {tuple(scale.shape)}; expected "
            f"({rows}, {cols // group}): one E8M0 scale per {group} inputs, the inputs a multiple of {group}."
        )
    _check_scale_dtype(scale, name)
    return rows, cols


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """FP8 ``[out, in]`` times its ``[ceil(out/bm), ceil(in/bn)]`` block scales -> float64 ``[out, in]``."""
    rows, cols = fp8_block_shape(weight, scale, block, name)
    bm, bn = block
    s = e8m0_to_float(scale, name).repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return weight.to(torch.float64) * s


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP, name: str = "weight") -> torch.Tensor:
    """Packed E2M1 ``[out, in/2]`` times one scale per ``group`` inputs ``[out, in/group]`` -> float64 ``[out, in]``."""
    rows, cols = fp4_shape(packed, scale, group, name)
    values = unpack_fp4_e2m1(packed).view(rows, cols // group, group)
    return (values * e8m0_to_float(scale, name).unsqueeze(-1)).view(rows, cols)


def _exact_copy(value: torch.Tensor) -> torch.Tensor:
    for dtype in (torch.bfloat16, torch.float32):
        out = value.to(dtype)
        if torch.equal(out.to(torch.float64), value):
            return out
    return value


def dequantize_tensors(tensors: dict[str, torch.Tensor], fmt: CheckpointFormat) -> dict[str, torch.Tensor]:
    """``tensors`` with every quantised ``X.weight`` replaced by its exact bf16 (else fp32) value and every
    ``X.scale`` removed; unquantised tensors pass through untouched."""
    quantised = {n for n, t in tensors.items() if t.dtype == _FP8 or t.dtype in _FP4_DTYPES}
    misnamed = sorted(n for n in quantised if not n.endswith(".weight"))
    if misnamed:
        raise CheckpointFormatError(f"tensors {misnamed[:3]} are {tensors[misnamed[0]].dtype}; only '<name>.weight' "
                                    "tensors (with '<name>.scale') may be FP8 / FP4.")
    other_fp8 = sorted(f"{n} ({t.dtype})" for n, t in tensors.items() if t.dtype.is_floating_point and t.dtype.itemsize == 1
                       and t.dtype not in (_FP8, torch.float8_e8m0fnu))
    if other_fp8:
        raise CheckpointFormatError(f"{fmt.source}: tensors {other_fp8[:3]} use a float8 kind the CPU loader does not read "
                                    "(read: float8_e4m3fn weights with float8_e8m0fnu scales).")
    if quantised and not fmt.quantized:
        raise CheckpointFormatError(f"{fmt.source} declares no quantization_config, but the folder holds quantised tensors, "
                                    f"e.g. {sorted(quantised)[0]!r} ({tensors[sorted(quantised)[0]].dtype}).")
    if quantised:
        check_cpu_readable(fmt)
    out = dict(tensors)
    for name in sorted(quantised):
        base = name[: -len(".weight")]
        scale = tensors.get(base + ".scale")
        if scale is None:
            raise CheckpointFormatError(f"tensor {name!r} is {tensors[name].dtype} but {base + '.scale'!r} is missing; "
                                        "a quantised weight needs its scales.")
        if tensors[name].dtype == _FP8:
            value = dequantize_fp8_block(tensors[name], scale, tuple(fmt.block_size), name)
        elif fmt.expert_dtype != "fp4":
            raise CheckpointFormatError(f"tensor {name!r} is packed FP4 ({tensors[name].dtype}) but {fmt.source} says "
                                        f"expert_dtype={fmt.expert_dtype!r}; expected expert_dtype 'fp4' for FP4 tensors.")
        else:
            value = dequantize_fp4(tensors[name], scale, name=name)
        out[name] = _exact_copy(value)
        del out[base + ".scale"]
    return out
