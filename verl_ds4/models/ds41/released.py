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
name the mapping does not know is an error that names it. With ``part="drafter"`` the ``mtp.<k>.*``
stages map onto :class:`~.dspark.DS41DSpark` (``mtp.layers.<k>.*``; released or our names).

Before a weight is read (``expected=``, or :func:`load_checked`, which the folder loader and the CPU
builder use): :func:`check_quantization_config` (only the released 32 x 32 UE8M0 layout), :func:`read_headers`
(dtypes and shapes from the safetensors headers as ``meta`` tensors; the index must match the shards), the
whole mapping run on those ``meta`` tensors (scale grids checked by ``hf_dequant.fp8_block_shape`` /
``fp4_shape``), then missing / unexpected / wrong-shape tensors against the model, named.

:func:`ours_to_released` is the writer's inverse map (``folder.save_folder(names="released")``): equal to
NeMo Automodel's ``to_hf`` names and values bit for bit (tests), unquantised.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from verl_ds4.models.ds4.hf_dequant import dequantize_fp4, dequantize_fp8_block, fp4_shape, fp8_block_shape

from . import names

__all__ = ["FP8_BLOCK", "FP4_GROUP", "RELEASED_QUANTIZATION", "name_style", "read_headers", "check_quantization_config",
           "dequantize_released", "released_to_ours", "ours_to_released", "read_folder_tensors", "load_checked",
           "describe_folder"]

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


def dequantize_released(tensors: dict[str, torch.Tensor], shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """Every ``<name>.weight`` with a ``<name>.scale`` decoded to float64: packed FP4 (int8) per row and 32
    inputs, FP8 Engram tables per row and 32 channels, other FP8 per 32 x 32 block. A quantised weight
    without its scale, or a scale without its weight, is an error. With ``shapes_only`` (``meta`` tensors
    from the safetensors headers) the same dtype and scale-grid rules are checked and the decoded tensors are
    ``meta`` of the decoded shape: no value is read."""
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(".scale")]:
        weight_key = key[: -len(".scale")] + ".weight"
        if weight_key not in tensors:
            raise ValueError(f"{key} is a scale without its weight {weight_key}: the checkpoint is incomplete.")
        weight, scale = out.pop(weight_key), out.pop(key)
        if weight.dtype in (torch.int8, torch.uint8):
            decode, args = (fp4_shape, dequantize_fp4)[not shapes_only], (FP4_GROUP,)
        else:
            block = (1, FP4_GROUP) if ".engram.embed." in weight_key else FP8_BLOCK
            decode, args = (fp8_block_shape, dequantize_fp8_block)[not shapes_only], (block,)
        value = decode(weight, scale, *args, weight_key)
        out[weight_key] = torch.empty(value, dtype=torch.float64, device="meta") if shapes_only else value
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


_DRAFTER_EXTRA = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight",
                  "norm.weight": "final_layernorm.weight", "markov_head.embed.weight": "markov_head.embed.weight",
                  "markov_head.head.weight": "markov_head.head.weight",
                  "confidence_head.proj.weight": "confidence_head.proj.weight"}
_W3 = re.compile(r"ffn\.(experts\.\d+|shared_experts)\.w3\.weight")
_TOP = {"embed.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight",
        "head.weight": "output_layer.weight"}
_SKIP_MTP, _SKIP_VISION, _SKIP_BIAS_VL = ("mtp (DSpark drafter, not built)", "vision tower", "routers' image-token bias (bias_vl)")


def released_to_ours(tensors: dict[str, torch.Tensor], has_drafter: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Released-name tensors (dequantised) -> ``(ours, skipped)``: our names, and the count of tensors left
    out per reason (``mtp.*`` without a drafter, the vision tower). With ``has_drafter`` the ``mtp.<k>.*``
    stages map onto :class:`~.dspark.DS41DSpark`'s ``mtp.layers.<k>.*``. Unknown names raise, naming them."""
    ours: dict[str, torch.Tensor] = {}
    skipped = {_SKIP_MTP: 0, _SKIP_VISION: 0, _SKIP_BIAS_VL: 0}
    unknown: list[str] = []

    for key in tensors:
        if key in _TOP:
            ours[_TOP[key]] = tensors[key]
        elif key.startswith("mtp.") and not has_drafter:
            skipped[_SKIP_MTP] += 1
        elif key.startswith(_TEXT_ONLY_SKIPPED):
            skipped[_SKIP_VISION] += 1
        elif key.endswith(".ffn.gate.bias_vl"):
            skipped[_SKIP_BIAS_VL] += 1
        elif (m := re.match(r"(layers|mtp)\.(\d+)\.(.+)$", key)) is not None:
            source, prefix = f"{m[1]}.{m[2]}.", ("decoder.layers." if m[1] == "layers" else "mtp.layers.") + f"{m[2]}."
            if _W3.fullmatch(m[3]):
                if key[: -len("w3.weight")] + "w1.weight" not in tensors:
                    unknown.append(key + " (no w1 beside it)")
                continue

            def put(name, value, prefix=prefix):
                ours[prefix + name] = value

            if m[1] == "mtp" and m[3] in _DRAFTER_EXTRA:
                put(_DRAFTER_EXTRA[m[3]], tensors[key])
            elif not _layer(m[3], lambda rel, source=source: tensors[source + rel], put):
                unknown.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"tensors DeepSeek-V4.1's released format does not name: {unknown[:5]}"
                         f"{f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else ''}; expected embed / norm / head, "
                         "layers.<i>.{attn,engram,ffn,hc_attn_*,hc_ffn_*,attn_norm,ffn_norm}.*, mtp.*, vision.*.")
    return ours, {k: v for k, v in skipped.items() if v}


def ours_to_released(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names (a :class:`~.model.DS41Model` / ``DS41MegatronModel`` state dict, and optionally a
    :class:`~.dspark.DS41DSpark`'s ``mtp.layers.<k>.*``) -> DeepSeek's released names, unquantised: the
    inverse of :func:`released_to_ours` (fused ``linear_fc1`` split into ``w1`` / ``w3``, the three mHC
    ``alpha_*`` stacked into ``hc_*_scale``). Megatron's ``_extra_state`` entries are dropped; any other
    name it does not know raises, naming it."""
    attention = dict(names.ATTENTION)
    engram = dict(names.ENGRAM)
    simple = {"input_layernorm.weight": "attn_norm.weight", "pre_mlp_layernorm.weight": "ffn_norm.weight",
              "mlp.router.weight": "ffn.gate.weight", "mlp.router.expert_bias": "ffn.gate.bias",
              "mlp.router.tid2eid": "ffn.gate.tid2eid"}
    drafter = {ours: theirs for theirs, ours in _DRAFTER_EXTRA.items()}
    top = {ours: theirs for theirs, ours in _TOP.items()}
    out: dict[str, torch.Tensor] = {}
    alphas: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        if key in top:
            out[top[key]] = value
            continue
        m = re.fullmatch(r"(decoder\.layers|mtp\.layers)\.(\d+)\.(.+)", key)
        if m is None:
            unknown.append(key)
            continue
        p, rel = ("layers." if m[1] == "decoder.layers" else "mtp.") + f"{m[2]}.", m[3]
        if rel in simple:
            out[p + simple[rel]] = value
        elif rel.startswith("self_attention.") and rel[len("self_attention."):] in attention:
            theirs = attention[rel[len("self_attention."):]]
            out[p + ("attn.attn_sink" if theirs == "sinks_param.weight" else "attn." + theirs)] = value
        elif rel.startswith("engram.") and rel[len("engram."):] in engram:
            out[p + "engram." + engram[rel[len("engram."):]]] = value
        elif h := re.fullmatch(r"(attn_hc|mlp_hc)\.(mapping_proj\.weight|bias|alpha_pre|alpha_post|alpha_res)", rel):
            site = "hc_attn_" if h[1] == "attn_hc" else "hc_ffn_"
            if h[2] == "mapping_proj.weight":
                out[p + site + "fn"] = value
            elif h[2] == "bias":
                out[p + site + "base"] = value
            else:
                alphas.setdefault(p + site + "scale", {})[h[2]] = value
        elif e := re.fullmatch(r"mlp\.(experts\.local_experts\.(\d+)|shared_experts)\.linear_fc([12])\.weight", rel):
            where = p + (f"ffn.experts.{e[2]}." if e[2] is not None else "ffn.shared_experts.")
            if e[3] == "2":
                out[where + "w2.weight"] = value
            else:
                half = value.shape[0] // 2
                out[where + "w1.weight"], out[where + "w3.weight"] = value[:half], value[half:]
        elif m[1] == "mtp.layers" and rel in drafter:
            out[p + drafter[rel]] = value
        else:
            unknown.append(key)
    for key, parts in alphas.items():
        if set(parts) != {"alpha_pre", "alpha_post", "alpha_res"}:
            unknown.append(f"{key} (only {sorted(parts)})")
            continue
        out[key] = torch.cat([parts[a].reshape(1) for a in ("alpha_pre", "alpha_post", "alpha_res")])
    if unknown:
        raise ValueError(f"tensors with no DeepSeek-V4.1 released name: {unknown[:5]}"
                         f"{f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else ''}; expected a DS41Model / "
                         "DS41MegatronModel state dict (decoder.layers.<i>.*) or a DS41DSpark one (mtp.layers.<k>.*).")
    return out


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


#: ``quantization_config`` of DeepSeek-V4.1's released folders, as far as the reader depends on it.
RELEASED_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def check_quantization_config(config: dict, source: str = "config.json") -> None:
    """Refuse a ``quantization_config`` the released V4.1 reader does not decode (it decodes DeepSeek-V4.1's
    fixed layout, :data:`RELEASED_QUANTIZATION`; FP4 experts and Engram tables per row and 32 inputs)."""
    text = config.get("text_config") or {}
    quant = config.get("quantization_config") or text.get("quantization_config")
    if quant is None:
        return
    if not isinstance(quant, dict):
        raise ValueError(f"{source}: quantization_config is {quant!r}; expected an object such as {RELEASED_QUANTIZATION}.")
    bad = [f"{k}={quant[k]!r} (expected {v!r})" for k, v in RELEASED_QUANTIZATION.items()
           if k in quant and (list(quant[k]) if k == "weight_block_size" and isinstance(quant[k], (list, tuple)) else quant[k]) != v]
    if bad:
        raise ValueError(
            f"{source}: quantization_config {'; '.join(bad)}: the DeepSeek-V4.1 reader decodes DeepSeek-V4.1's released "
            "format only (FP8 e4m3 with UE8M0 scales per 32 x 32 block, FP4 experts and Engram tables with one scale per "
            "row and 32 inputs). Dequantise the folder to bf16 / fp32 first; a DeepSeek-V4 folder (128 x 128 blocks) "
            "is read by the V4 model (--model ds4)."
        )


def read_headers(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """``(tensors, files)``: every tensor of the folder's safetensors files as a ``meta`` tensor of its dtype and
    shape, read from the headers only, and the file each lives in. With ``model.safetensors.index.json`` the
    index must name exactly the tensors the files hold, each in its file."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors file: expected the weights of a DeepSeek-V4.1 folder.")
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file in files:
        with open(file, "rb") as f:
            raw = f.read(8)
            size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            try:
                header = json.loads(f.read(size)) if size > 0 else None
            except (ValueError, MemoryError):
                header = None
        if not isinstance(header, dict):
            raise ValueError(f"{file} is not a readable safetensors file (its header does not parse).")
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in tensors:
                raise ValueError(f"tensors {[name]} appear in more than one safetensors file of {folder}.")
            dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise ValueError(f"{file}: tensor {name!r} has dtype {entry.get('dtype')!r}, which the DeepSeek-V4.1 reader "
                                 f"does not read (read: {sorted(_SAFETENSORS_DTYPES)}).")
            tensors[name] = torch.empty(entry["shape"], dtype=dtype, device="meta")
            where[name] = file
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: expected JSON with a 'weight_map' object ({e}).") from e
        listed_only = sorted(set(weight_map) - set(tensors))
        unlisted = sorted(set(tensors) - set(weight_map))
        moved = sorted(k for k in set(weight_map) & set(tensors) if weight_map[k] != where[k].name)
        if listed_only or unlisted or moved:
            raise ValueError(f"{index} does not match the safetensors files: listed but absent {listed_only[:3]}, "
                             f"present but not listed {unlisted[:3]}, in another file {moved[:3]}. Rewrite the index "
                             "from the files (or restore the missing shard).")
    return tensors, where


def _map(tensors: dict[str, torch.Tensor], config: dict, part: str, shapes_only: bool) -> tuple[dict[str, torch.Tensor], str, dict[str, int]]:
    style = name_style(tensors) if part == "model" else ("ours" if any(k.startswith("mtp.layers.") for k in tensors) else "released")
    if style == "ours":
        drafter = sum(k.startswith("mtp.") for k in tensors) if part == "model" else 0
        return {k: v for k, v in tensors.items() if part == "drafter" or not k.startswith("mtp.")}, style, (
            {_SKIP_MTP: drafter} if drafter else {})
    if style == "nemo":
        text = config.get("text_config") or config
        rows = dict(zip(text.get("engram_layer_ids") or [], text.get("engram_num_embeddings") or []))
        tensors = _nemo_as_released({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, rows) | {
            k: v for k, v in tensors.items() if k.startswith("mtp.")}
    ours, skipped = released_to_ours(dequantize_released(tensors, shapes_only=shapes_only), has_drafter=part == "drafter")
    return ours, style, skipped


def read_folder_tensors(folder: str | Path, config: dict, has_drafter: bool = False, expected: dict | None = None,
                        skip: frozenset | set = frozenset(), part: str = "model") -> tuple[dict[str, torch.Tensor], str, dict[str, int]]:
    """The folder's tensors under our names: ``(tensors, style, skipped)``. Reads ``model.safetensors`` or
    every ``*.safetensors`` shard; released and NeMo names are mapped, FP8 / FP4 dequantised.

    ``part``: ``"model"`` (the text model; ``mtp.*`` counted in ``skipped``) or ``"drafter"`` (only the
    ``mtp.*`` tensors, as :class:`~.dspark.DS41DSpark` names them). With ``expected`` (our name -> tensor or
    shape), every rule is checked on the headers before a weight is read: the quantisation config, the scale
    grids, the names (missing and unexpected ones named) and the decoded shapes; ``skip`` names tensors not
    wanted (e.g. the LM head under a value head). ``has_drafter`` is the old spelling of ``part="drafter"``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    part = "drafter" if has_drafter else part
    if part not in ("model", "drafter"):
        raise ValueError(f"part must be 'model' or 'drafter', got {part!r}")  # error-catalogue: internal: a caller passed a bad argument
    check_quantization_config(config, str(folder / "config.json"))
    headers, where = read_headers(folder)
    if part == "drafter":
        headers = {k: v for k, v in headers.items() if k.startswith("mtp.")}
    plan, style, skipped = _map(headers, config, part, shapes_only=True)
    if expected is not None:
        _check_fits(folder, plan, expected, skip)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({where[k] for k in headers}):
        tensors.update({k: v for k, v in load_file(str(file)).items() if k in headers})
    ours, _, _ = _map(tensors, config, part, shapes_only=False)
    return {k: v for k, v in ours.items() if k not in skip}, style, skipped


def describe_folder(folder: str | Path, config: dict) -> str:
    """One line on what a V4.1 folder's safetensors hold, from the headers only (no weight is read): the name
    style, the format (FP8 / FP4 counts), the tensor and file counts and what the text model leaves out. Every
    rule :func:`read_folder_tensors` checks before reading is checked here too (the quantisation config, the
    index, dtypes, scale grids, unknown names), so a bad folder raises ``ValueError`` naming the problem."""
    folder = Path(folder)
    check_quantization_config(config, str(folder / "config.json"))
    headers, where = read_headers(folder)
    _, style, skipped = _map(headers, config, "model", shapes_only=True)
    drafter = {k: v for k, v in headers.items() if k.startswith("mtp.")}
    if drafter:
        _map(drafter, config, "drafter", shapes_only=True)
    fp8 = sum(v.dtype == torch.float8_e4m3fn for k, v in headers.items() if k.endswith(".weight"))
    fp4 = sum(v.dtype in (torch.int8, torch.uint8) for k, v in headers.items() if k.endswith(".weight"))
    if fp8 or fp4:
        fmt = (f"{fp8} FP8 e4m3 weights (UE8M0 scales per 32 x 32 block, Engram tables per row and 32 channels) and "
               f"{fp4} FP4 expert weights (per row and 32 inputs), which verl-ds4's reader dequantises on load")
    else:
        fmt = "unquantised weights"
    style_name = {"ours": "verl-ds4's", "released": "DeepSeek's released", "nemo": "NeMo Automodel's"}[style]
    left_out = "; ".join(f"{n} {what}" for what, n in skipped.items())
    return (f"a DeepSeek-V4.1 folder in {style_name} names: {len(headers)} tensors in {len(set(where.values()))} "
            f"file(s), {fmt}" + (f"; not part of the text model: {left_out}" if left_out else ""))


def _shape(value) -> tuple:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def _check_fits(folder: Path, plan: dict, expected: dict, skip) -> None:
    wanted = {k: v for k, v in expected.items() if not k.endswith("_extra_state") and k not in skip}
    got = {k for k in plan if k not in skip}
    missing = sorted(set(wanted) - got)
    unexpected = sorted(got - set(wanted))
    wrong = sorted(k for k in set(wanted) & got if _shape(plan[k]) != _shape(wanted[k]))
    if missing or unexpected or wrong:
        raise ValueError(
            f"{folder} does not fit its config.json: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {[(k, _shape(plan[k]), _shape(wanted[k])) for k in wrong[:5]]}. "
            "Write the folder with verl_ds4.models.ds41.folder.save_folder from the same config."
        )


def load_checked(module: torch.nn.Module, folder: str | Path, config: dict, skip: frozenset | set = frozenset(),
                 part: str = "model") -> tuple[str, dict[str, int]]:
    """Load ``folder`` into ``module`` (a ``DS41Model``, ``DS41MegatronModel`` or, with ``part="drafter"``, a
    ``DS41DSpark``): every rule checked on the headers first (:func:`read_folder_tensors`), then the weights
    read, decoded and copied in the module's dtypes. Returns ``(style, skipped)``."""
    expected = module.state_dict()
    tensors, style, skipped = read_folder_tensors(folder, config, expected=expected, skip=skip, part=part)
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)
    return style, skipped
