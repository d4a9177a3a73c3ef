"""DeepSeek-V4.1 weights in DeepSeek's released on-disk format, read into our names.

The released ``DeepSeek-V4.1-Flash`` safetensors use the names of DeepSeek's inference code
(``embed.weight``, ``layers.<i>.attn.wq_a.weight``, ``layers.<i>.hc_attn_fn``,
``layers.<i>.ffn.experts.<j>.w1.weight``, ``mtp.<k>.*`` for the DSpark drafter, ...) and store:

* FP8 E4M3 dense projections (``attn.{wq_a, wq_b, wkv, wo_a, wo_b}``, ``attn.indexer.wq_b``,
  ``ffn.shared_experts.w{1,2,3}``, ``engram.wkv``) with one UE8M0 scale per **32 x 32** block
  (``<name>.scale``, ``[ceil(out/32), ceil(in/32)]``);
* FP4 E2M1 routed experts, two values per byte (low nibble first), one UE8M0 scale per row and
  32 inputs (``[out, in/32]``);
* FP8 E4M3 Engram tables ``[rows, 256]`` with one UE8M0 scale per row and 32 channels;
* everything else (norms, router, mHC mixers, compressor, indexer keys, attention sink,
  embedding, head) in bf16 / fp32.

:func:`read_folder_tensors` reads a folder's safetensors (one file or shards) in any of three name
styles, ours (``decoder.layers.<i>...``, what :func:`~.folder.save_folder` writes), DeepSeek's released
names above, or NeMo Automodel's in-memory names (``model.layers.<i>...``), and returns our names,
dequantised exactly (float64 products of FP8 / FP4 values and powers of two, with V4's kernels of
:mod:`verl_ds4.models.ds4.hf_dequant`). Tensors the text model does not build are left out and
counted (``mtp.*`` when the model has no drafter, the vision tower and the routers' image-token bias
``ffn.gate.bias_vl``); nothing else is dropped: a
name the mapping does not know is an error that names it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from verl_ds4.models.ds4.hf_dequant import dequantize_fp4, dequantize_fp8_block

from . import names

__all__ = ["FP8_BLOCK", "FP4_GROUP", "name_style", "dequantize_released", "released_to_ours", "read_folder_tensors"]

#: The released dense FP8 block (rows x columns); Engram tables use one row x 32 columns.
FP8_BLOCK = (32, 32)
FP4_GROUP = 32

_MLP_HC = {"attn": "attn_hc", "ffn": "mlp_hc"}
_TEXT_ONLY_SKIPPED = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def name_style(keys) -> str:
    """``"ours"``, ``"released"`` (DeepSeek's on-disk names) or ``"nemo"`` (``model.layers.*``), from the keys."""
    keys = list(keys)
    if any(k.startswith(("decoder.", "embedding.word_embeddings")) for k in keys):
        return "ours"
    if any(k.startswith(("model.layers.", "model.embed_tokens")) for k in keys):
        return "nemo"
    if any(k.startswith(("layers.", "embed.")) for k in keys):
        return "released"
    raise ValueError(f"cannot tell the name style of these tensors (first: {keys[:3]}); expected our names "
                     "(decoder.layers.*), DeepSeek's released names (layers.*, embed.weight) or NeMo's (model.layers.*).")


def dequantize_released(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ``<name>.weight`` with a ``<name>.scale`` decoded to float64: packed FP4 (int8) per row and 32
    inputs, FP8 Engram tables per row and 32 channels, other FP8 per 32 x 32 block. A quantised weight
    without its scale, or a scale without its weight, is an error."""
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(".scale")]:
        weight_key = key[: -len(".scale")] + ".weight"
        if weight_key not in tensors:
            raise ValueError(f"{key} is a scale without its weight {weight_key}: the checkpoint is incomplete.")
        weight, scale = out.pop(weight_key), out.pop(key)
        if weight.dtype in (torch.int8, torch.uint8):
            out[weight_key] = dequantize_fp4(weight, scale, FP4_GROUP, weight_key)
        elif ".engram.embed." in weight_key:
            out[weight_key] = dequantize_fp8_block(weight, scale, (1, FP4_GROUP), weight_key)
        else:
            out[weight_key] = dequantize_fp8_block(weight, scale, FP8_BLOCK, weight_key)
    raw = sorted(k for k, v in out.items() if v.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8) and k.endswith(".weight"))
    if raw:
        raise ValueError(f"quantised weights without a .scale tensor: {raw[:5]}; the checkpoint is incomplete "
                         "(each FP8 / FP4 weight of DeepSeek's format has <name>.scale beside it).")
    return out


def _layer(rel: str, value_of, put) -> bool:
    """One released layer tensor (``rel`` below ``layers.<i>.``) under our name; False when unknown."""
    attention = {theirs: ours for ours, theirs in names.ATTENTION.items()}
    attention["attn_sink"] = "core_attention.attn_sink"
    engram = {theirs: ours for ours, theirs in names.ENGRAM.items()}
    simple = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "pre_mlp_layernorm.weight",
              "ffn.gate.weight": "mlp.router.weight", "ffn.gate.bias": "mlp.router.expert_bias",
              "ffn.gate.tid2eid": "mlp.router.tid2eid"}
    if rel in simple:
        put(simple[rel], value_of(rel))
    elif rel.startswith("attn.") and rel[len("attn."):] in attention:
        put("self_attention." + attention[rel[len("attn."):]], value_of(rel))
    elif rel.startswith("engram.") and rel[len("engram."):] in engram:
        put("engram." + engram[rel[len("engram."):]], value_of(rel))
    elif m := re.fullmatch(r"hc_(attn|ffn)_(fn|base|scale)", rel):
        site, part = _MLP_HC[m[1]], m[2]
        value = value_of(rel)
        if part == "fn":
            put(f"{site}.mapping_proj.weight", value)
        elif part == "base":
            put(f"{site}.bias", value)
        else:
            for i, alpha in enumerate(("alpha_pre", "alpha_post", "alpha_res")):
                put(f"{site}.{alpha}", value[i].reshape(1))
    elif m := re.fullmatch(r"ffn\.(experts\.(\d+)|shared_experts)\.w([123])\.weight", rel):
        where = f"mlp.experts.local_experts.{m[2]}" if m[2] is not None else "mlp.shared_experts"
        if m[3] == "2":
            put(f"{where}.linear_fc2.weight", value_of(rel))
        elif m[3] == "1":  # gate rows, then up rows (w3): our fused fc1
            put(f"{where}.linear_fc1.weight", torch.cat([value_of(rel), value_of(rel[:-len("w1.weight")] + "w3.weight")]))
        # w3 is taken with w1
    else:
        return False
    return True


def released_to_ours(tensors: dict[str, torch.Tensor], has_drafter: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Released-name tensors (dequantised) -> ``(ours, skipped)``: our names, and the count of tensors left
    out per reason (``mtp.*`` without a drafter, the vision tower). Unknown names raise, naming them."""
    ours: dict[str, torch.Tensor] = {}
    skipped = {"mtp (DSpark drafter, not built)": 0, "vision tower": 0, "routers' image-token bias (bias_vl)": 0}
    unknown: list[str] = []
    top = {"embed.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight",
           "head.weight": "output_layer.weight"}

    for key in tensors:
        if key in top:
            ours[top[key]] = tensors[key]
        elif key.startswith("mtp.") and not has_drafter:
            skipped["mtp (DSpark drafter, not built)"] += 1
        elif key.startswith(_TEXT_ONLY_SKIPPED):
            skipped["vision tower"] += 1
        elif key.endswith(".ffn.gate.bias_vl"):
            skipped["routers' image-token bias (bias_vl)"] += 1
        elif (m := re.match(r"layers\.(\d+)\.(.+)$", key)) is not None:
            prefix = f"decoder.layers.{m[1]}."
            if m[2].endswith("w3.weight") and re.fullmatch(r"ffn\.(experts\.\d+|shared_experts)\.w3\.weight", m[2]):
                if key[: -len("w3.weight")] + "w1.weight" not in tensors:
                    unknown.append(key + " (no w1 beside it)")
                continue

            def put(name, value, prefix=prefix):
                ours[prefix + name] = value

            if not _layer(m[2], lambda rel, i=m[1]: tensors[f"layers.{i}.{rel}"], put):
                unknown.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"tensors DeepSeek-V4.1's released format does not name: {unknown[:5]}"
                         f"{f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else ''}; expected embed / norm / head, "
                         "layers.<i>.{attn,engram,ffn,hc_attn_*,hc_ffn_*,attn_norm,ffn_norm}.*, mtp.*, vision.*.")
    return ours, {k: v for k, v in skipped.items() if v}


def _nemo_to_released(key: str) -> str:
    """NeMo Automodel's in-memory name -> the released name, for the tensors both have one for (NeMo stacks the
    routed experts: those are split in :func:`read_folder_tensors`)."""
    if key.startswith("model.embed_tokens."):
        return "embed." + key[len("model.embed_tokens."):]
    if key.startswith("lm_head."):
        return "head." + key[len("lm_head."):]
    key = key[len("model."):] if key.startswith("model.") else key
    key = re.sub(r"^layers\.(\d+)\.(attn|ffn)_hc\.(fn|base|scale)$", r"layers.\1.hc_\2_\3", key)
    key = re.sub(r"\.attn\.sinks_param\.weight$", ".attn.attn_sink", key)
    key = re.sub(r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.gate.bias", key)
    for theirs, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        key = re.sub(rf"\.ffn\.shared_experts\.{theirs}\.", f".ffn.shared_experts.{w}.", key)
    return key


def _nemo_as_released(tensors: dict[str, torch.Tensor], engram_rows: dict[int, int]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.ffn\.experts\.(gate_and_up_projs|down_projs)", key)
        if m:  # [E, h, 2I] / [E, I, h]: per expert [out, in]
            for e in range(value.shape[0]):
                matrix = value[e].T
                if m[2] == "down_projs":
                    out[f"layers.{m[1]}.ffn.experts.{e}.w2.weight"] = matrix
                else:
                    half = matrix.shape[0] // 2
                    out[f"layers.{m[1]}.ffn.experts.{e}.w1.weight"] = matrix[:half]
                    out[f"layers.{m[1]}.ffn.experts.{e}.w3.weight"] = matrix[half:]
            continue
        name = _nemo_to_released(key)
        e = re.fullmatch(r"layers\.(\d+)\.engram\.embed\.weight", name)
        if e and int(e[1]) in engram_rows:  # NeMo pads the table rows to its owner group
            value = value[: engram_rows[int(e[1])]]
        out[name] = value
    return out


def read_folder_tensors(folder: str | Path, config: dict, has_drafter: bool = False) -> tuple[dict[str, torch.Tensor], str, dict[str, int]]:
    """The folder's tensors under our names: ``(tensors, style, skipped)``. Reads ``model.safetensors`` or
    every ``*.safetensors`` shard; released and NeMo names are mapped, FP8 / FP4 dequantised."""
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors file: expected the weights of a DeepSeek-V4.1 folder.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(file))
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise ValueError(f"tensors {twice[:3]} appear in more than one safetensors file of {folder}.")
        tensors.update(part)
    style = name_style(tensors)
    if style == "ours":
        return tensors, style, {}
    if style == "nemo":
        layers = config.get("engram_layer_ids") or []
        rows = dict(zip(layers, config.get("engram_num_embeddings") or []))
        tensors = _nemo_as_released({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, rows) | {
            k: v for k, v in tensors.items() if k.startswith("mtp.")}
    ours, skipped = released_to_ours(dequantize_released(tensors), has_drafter=has_drafter)
    return ours, style, skipped
