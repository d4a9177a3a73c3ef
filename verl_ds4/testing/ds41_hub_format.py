"""Write a tiny DeepSeek-V4.1 folder in DeepSeek's released on-disk format (for tests).

    folder, exact = write_ds41_hub_folder(state, config, root / "hub", tokenizer, drafter_state=None, shards=2)

``state`` is a V4.1 model's state dict in our names (``DS41Model`` / ``DS41MegatronModel``; optionally
``drafter_state``, a ``DS41DSpark``'s). The folder holds what the released ``DeepSeek-V4.1-Flash`` holds, as
NeMo Automodel 0.7.0's adapter describes it (``deepseek_v41/state_dict_adapter.py``, read, not copied):

* DeepSeek's names (:func:`verl_ds4.models.ds41.released.ours_to_released`);
* FP8 E4M3 dense projections with one UE8M0 scale per 32 x 32 block (``attn.{wq_a, wq_b, wkv, wo_a,
  wo_b}``, ``attn.indexer.wq_b``, ``ffn.shared_experts.w{1,2,3}``, ``engram.wkv``; the drafter's
  ``attn.*``, ``main_proj`` and shared experts);
* FP4 E2M1 routed experts (``ffn.experts.<j>.w{1,2,3}``, the drafter's too) two per ``int8`` byte with
  one UE8M0 scale per row and 32 inputs;
* FP8 Engram tables with one scale per row and 32 channels;
* float32 where NeMo keeps float32 (``_keep_in_fp32_modules_strict``): mHC mixers (``hc_*``), attention
  sinks, the compressors' ``wkv`` / ``wgate``, the routers' biases (``ffn.gate.bias``, the image-token
  ``ffn.gate.bias_vl``, written per layer and drafter stage, random) and the head; bf16 for the rest (norms,
  embedding, router weights, indexer keys, the drafter's heads);
* ``shards`` safetensors files with ``model.safetensors.index.json``, ``config.json`` with the released
  ``quantization_config``, and the tokenizer.

``exact`` is what a correct reader must return, in our names, float64: the dequantised values
(products of FP8 / FP4 values and powers of two, exact in float64) and the bf16 / fp32 roundings.
The quantisers are :mod:`verl_ds4.testing.ds4_hub_format`'s (V4's hub format: 128 x 128 blocks), used
here with V4.1's 32 x 32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from verl_ds4.testing.ds4_hub_format import quantize_fp4, quantize_fp8_block

__all__ = ["FP8_NAMES", "FP4_NAMES", "released_storage", "quantise_released", "write_ds41_hub_folder"]

FP8_NAMES = re.compile(
    r"layers\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight"
    r"|mtp\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|main_proj|ffn\.shared_experts\.w[123])\.weight"
)
FP4_NAMES = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_ENGRAM_TABLE = re.compile(r"layers\.\d+\.engram\.embed\.weight")
# NeMo's _keep_in_fp32_modules_strict, in released names: mHC, sinks, the compressor, the router biases, the head.
_FP32_NAMES = re.compile(r"hc_(?:attn|ffn)_(?:fn|base|scale)$|\.attn\.attn_sink$|\.attn\.compressor\.(?:wgate|wkv)\.weight$"
                         r"|\.ffn\.gate\.(?:bias|bias_vl)$|^head\.weight$")


def released_storage(name: str) -> str:
    """How the released folder stores a (released-named) tensor: ``fp8``, ``fp4``, ``fp8_rows``, ``int``,
    ``fp32`` or ``bf16``."""
    if name.endswith("tid2eid"):
        return "int"
    if FP4_NAMES.fullmatch(name):
        return "fp4"
    if _ENGRAM_TABLE.fullmatch(name):
        return "fp8_rows"
    if FP8_NAMES.fullmatch(name):
        return "fp8"
    return "fp32" if _FP32_NAMES.search(name) else "bf16"


def quantise_released(named: dict[str, torch.Tensor], block: tuple[int, int] = (32, 32)) -> tuple[dict, dict]:
    """``(stored, exact)`` for released-named tensors: the on-disk tensors (with ``<name>.scale``) and the
    float64 values a reader must decode. ``block``: the dense FP8 block (32 x 32 in V4.1; tests pass
    another to build a folder that must be refused)."""
    stored, exact = {}, {}
    for name, value in named.items():
        kind = released_storage(name)
        if kind in ("fp8", "fp8_rows", "fp4"):
            if kind == "fp4":
                q, scale, exact[name] = quantize_fp4(value, 32)
            else:
                q, scale, exact[name] = quantize_fp8_block(value, block if kind == "fp8" else (1, 32))
            stored[name], stored[name[: -len(".weight")] + ".scale"] = q, scale
        elif kind == "int":
            stored[name] = exact[name] = value.to(torch.int64)
        else:
            stored[name] = value.to(torch.float32 if kind == "fp32" else torch.bfloat16)
            exact[name] = stored[name].to(torch.float64)
    return stored, exact


def write_ds41_hub_folder(state: dict[str, torch.Tensor], config: dict[str, Any], folder: str | Path, tokenizer=None,
                          drafter_state: dict[str, torch.Tensor] | None = None, shards: int = 2,
                          extra: dict[str, torch.Tensor] | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """``(folder, exact)``: the released-format folder of ``state`` (and ``drafter_state``) and the float64
    values a reader must return, in our names. ``extra``: released-named tensors written as they are
    (e.g. vision-tower tensors)."""
    from safetensors.torch import save_file

    from verl_ds4.models.ds41.released import RELEASED_QUANTIZATION, ours_to_released, released_to_ours

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ours = {k: v.detach().to(torch.float64) if v.is_floating_point() else v.detach()
            for k, v in {**state, **(drafter_state or {})}.items() if not k.endswith("_extra_state")}
    named = ours_to_released(ours)
    gen = torch.Generator().manual_seed(0)
    for key in [k for k in named if k.endswith(".ffn.gate.bias")]:
        named[key + "_vl"] = 0.1 * torch.randn(named[key].shape, generator=gen, dtype=torch.float64)
    stored, exact = quantise_released(named)
    stored.update(extra or {})
    names = sorted(stored)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: stored[n].contiguous() for n in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    quant = {**RELEASED_QUANTIZATION, "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder, released_to_ours(exact, has_drafter=drafter_state is not None)[0]  # bias_vl: counted, not ours
