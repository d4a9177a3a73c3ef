"""Write a tiny DS4 in the hub's on-disk format, and its dequantised twin (tests only).

    randomize_ds4_(model, seed)                          # every weight and routing buffer random
    hub, twin = write_hub_folders(model, config, root, block_size=(8, 16))

``hub``: DeepSeek's native names, sharded with ``model.safetensors.index.json``; attention and shared
expert linears FP8 e4m3 with one UE8M0 scale per block (``X.scale``), routed experts (MTP's too) FP4
e2m1 two per byte (int8, low nibble first) with one E8M0 scale per 32 inputs; embedding, head,
compressors, router, norms and the indexer's ``weights_proj`` bf16; mHC, ``ape``, sinks and gate
bias fp32; ``tid2eid`` int64; ``config.json`` with the hub's ``quantization_config`` (the block size
as given: the hub's is 128 x 128, a tiny model needs a block that tiles its small matrices) and
``expert_dtype: fp4``.

``twin``: transformers' names, float32, holding exactly the values the quantiser chose (computed
from the chosen grid values and power-of-two scales, not by unpacking the files), and no
``quantization_config``. The quantisers here are independent of :mod:`verl_ds4.models.ds4.hf_dequant`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

__all__ = ["randomize_ds4_", "quantize_fp8_block", "quantize_fp4", "hub_storage", "write_hub_folders"]

_FP8_MAX = 448.0
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
_FP8_NAMES = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|shared_experts\.w[123])\.weight$")
_FP4_NAMES = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
_FP32_NAMES = re.compile(r"(hc_\w+|\.ape|attn_sink|gate\.bias)$")


def randomize_ds4_(model: torch.nn.Module, seed: int) -> None:
    """Random weights of O(1) effect: norms and mHC scales near 1, matrices ~ 1/sqrt(fan-in), routing
    biases that change the choice, a hash table of distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "alpha_" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.dim() >= 2:
                p.copy_(noise * p.shape[-1] ** -0.5 * (2.0 if "experts" in name else 1.0))
            else:
                p.copy_(0.5 * noise)
        for name, buf in sorted(model.named_buffers()):
            if name.endswith("expert_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen, dtype=torch.float64))
            elif name.endswith("tid2eid"):
                n_experts = int(model.config.num_moe_experts)
                buf.copy_(torch.stack([torch.randperm(n_experts, generator=gen)[: buf.shape[1]] for _ in range(buf.shape[0])]))


def _e8m0(exponent: torch.Tensor) -> torch.Tensor:
    return (exponent.to(torch.int64) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _exponent(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Smallest integer e with amax / 2**e <= top (0 for an all-zero block)."""
    safe = torch.where(amax > 0, amax, torch.full_like(amax, top))
    return torch.ceil(torch.log2(safe / top))


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]):
    """``(fp8 weight, UE8M0 scales [ceil(out/bm), ceil(in/bn)], exact float64 value)``."""
    (rows, cols), (bm, bn) = w.shape, block
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(gr * bm, gc * bn, dtype=torch.float64)
    padded[:rows, :cols] = w.double().abs()
    exponent = _exponent(padded.view(gr, bm, gc, bn).amax(dim=(1, 3)), _FP8_MAX)
    s = torch.pow(2.0, exponent).repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    q = (w.double() / s).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, _e8m0(exponent), q.to(torch.float64) * s


def quantize_fp4(w: torch.Tensor, group: int = 32):
    """``(int8 [out, in/2] low nibble first, E8M0 scales [out, in/group], exact float64 value)``."""
    rows, cols = w.shape
    x = w.double().view(rows, cols // group, group)
    exponent = _exponent(x.abs().amax(dim=-1), 6.0)
    scaled = x / torch.pow(2.0, exponent).unsqueeze(-1)
    index = (scaled.abs().unsqueeze(-1) - _E2M1).abs().argmin(dim=-1)
    negative = scaled < 0
    value = torch.where(negative, -_E2M1[index], _E2M1[index]) * torch.pow(2.0, exponent).unsqueeze(-1)
    nibble = (index | (negative.to(torch.int64) << 3)).view(rows, cols)
    packed = (nibble[:, 0::2] | (nibble[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, _e8m0(exponent), value.view(rows, cols)


def hub_storage(native_name: str) -> str:
    """How the hub stores a native tensor: ``fp8``, ``fp4``, ``fp32``, ``int`` or ``bf16``."""
    if native_name.endswith("tid2eid"):
        return "int"
    if _FP4_NAMES.search(native_name):
        return "fp4"
    if _FP8_NAMES.search(native_name):
        return "fp8"
    return "fp32" if _FP32_NAMES.search(native_name) else "bf16"


def _name_pairs(model) -> list[tuple[str, str]]:
    from verl_ds4.models.ds4.hf_names import name_groups

    tied = model.share_embeddings_and_output_weights
    pairs = []
    for native, hf in zip(name_groups(model.config, "native", tied), name_groups(model.config, "transformers", tied)):
        pairs += list(zip(native.files, hf.files))
    return pairs


def write_hub_folders(model, config: dict, root: str | Path, block_size=(128, 128), shards: int = 2) -> tuple[Path, Path]:
    """``(hub folder, twin folder)`` under ``root`` for ``model``'s weights (see the module docstring)."""
    from safetensors.torch import save_file

    from verl_ds4.models.ds4.hf_checkpoint import hf_tensors_of

    root = Path(root)
    hub, twin = root / "hub", root / "twin"
    hub.mkdir(parents=True, exist_ok=True)
    twin.mkdir(parents=True, exist_ok=True)
    values = hf_tensors_of(model, "native", dtypes={n: torch.float64 for n, _ in _name_pairs(model)})
    stored, exact = {}, {}
    for name, value in values.items():
        kind = hub_storage(name)
        if kind in ("fp8", "fp4"):
            q, scale, exact[name] = quantize_fp8_block(value, block_size) if kind == "fp8" else quantize_fp4(value)
            stored[name], stored[name[: -len(".weight")] + ".scale"] = q, scale
        elif kind == "int":
            stored[name] = exact[name] = value.to(torch.int64)
        else:
            stored[name] = value.to(torch.float32 if kind == "fp32" else torch.bfloat16)
            exact[name] = stored[name].to(torch.float64)
    names = sorted(stored)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: stored[n].contiguous() for n in names[i::shards]}
        save_file(part, str(hub / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (hub / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": list(block_size),
             "activation_scheme": "dynamic"}
    (hub / "config.json").write_text(json.dumps({**config, "quantization_config": quant, "expert_dtype": "fp4"}, indent=1))
    twin_tensors = {hf: exact[native].to(torch.float32 if exact[native].is_floating_point() else torch.int64)
                    for native, hf in _name_pairs(model)}
    assert all(torch.equal(twin_tensors[hf].to(exact[n].dtype), exact[n]) for n, hf in _name_pairs(model))  # fp32 holds them
    save_file(twin_tensors, str(twin / "model.safetensors"), metadata={"format": "pt"})
    (twin / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}, indent=1))
    return hub, twin
