"""Load an HF DeepSeek-V4 folder into :class:`~.model.DS4Model` and save the model back.

    model, info = load_hf_checkpoint(folder, dtype=torch.float64)     # builds and fills the model
    save_hf_checkpoint(model, out_folder, info)                        # same names, dtypes, bits

A folder is ``config.json`` (``model_type: deepseek_v4``) plus ``*.safetensors`` (one file or
several with ``model.safetensors.index.json``), named in either family of :mod:`.hf_names`.
Before any weight is assigned, every tensor is checked: a missing tensor, an unexpected tensor or
a shape that does not match the config raises :class:`HFCheckpointError` naming the tensor, the
expected and the found shape; nothing is left at its random initial value. Loading casts to the
model's dtype (integer tables stay ``int64``); saving casts each tensor back to the dtype it was
read in, so a load -> save round trip is bit-identical (fp32 / bf16 -> fp64 -> back is exact).
MTP tensors (``mtp.k.*``, DeepSeek's native names in either family) fill ``model.mtp`` when the
config has ``num_nextn_predict_layers > 0``; with ``allow_mtp_skip=True`` (no MTP block) they are
skipped and then not saved.

Quantised folders in the hub's on-disk format (FP8 e4m3 + UE8M0 block scales, FP4 routed experts +
E8M0 scales, ``X.scale`` beside ``X.weight``; :mod:`.checkpoint_format`) are dequantised on read,
exactly (:mod:`.hf_dequant`); a quantisation the CPU loader does not read is refused before any
tensor is read, naming what was found and what is read. Saving writes the dequantised (bf16) values
and a ``config.json`` without ``quantization_config``. A DSpark drafter checkpoint (Flash-0731 /
Pro-0813: ``mtp.*`` is a drafter although ``num_nextn_predict_layers`` says 1) is never loaded as
MTP: refused unless ``allow_mtp_skip=True`` (then the drafter is skipped).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verl_ds4 import ds41_facts, ds4_facts

from .checkpoint_format import CheckpointFormatError, check_cpu_readable, checkpoint_format_from, read_checkpoint_format
from .hf_names import detect_family, name_groups

__all__ = ["HFCheckpointError", "CheckpointInfo", "read_hf_tensors", "load_hf_checkpoint", "load_into", "save_hf_checkpoint"]


class HFCheckpointError(ValueError):
    """An HF DS4 folder that does not match its config (or is not a DS4 folder)."""


@dataclass
class CheckpointInfo:
    """What a load saw: the folder, the name family and each file tensor's dtype (for saving)."""

    folder: Path | None
    family: str
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def read_config(folder: str | Path) -> dict:
    """``config.json`` of a DS4 folder; raises unless ``model_type`` is ``deepseek_v4``."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"{folder} has no config.json: expected an HF DeepSeek-V4 folder (config.json + *.safetensors).")
    data = json.loads(path.read_text())
    refused = ds41_facts.check_model_type(data, "ds4")
    if refused:
        raise HFCheckpointError(f"{path}: {refused.engine_message()}")
    if data.get("model_type") != "deepseek_v4":
        raise HFCheckpointError(f"{path}: model_type is {data.get('model_type')!r}, expected 'deepseek_v4'.")
    if isinstance(data.get("text_config"), dict):  # transformers' DeepseekV4Config would build its default sizes
        raise HFCheckpointError(f"{path}: text_config: a DeepSeek-V4 config.json is flat (transformers' and NeMo "
                                "Automodel's DeepseekV4Config write every key at the top level), and this nested one "
                                "would be read as the default V4 with its sizes. Move the text_config keys to the top "
                                "level, or point at a DeepSeek-V4.1 folder with --model ds41.")
    try:
        compressed = any(ds4_facts.layer_compress_ratios(data))
    except (TypeError, ValueError):
        compressed = True  # transformers' own check names a bad layer schedule
    problems = ds4_facts.check_rope(data, compressed, yarn_only=False, released=ds4_facts.FLASH_YARN)
    if problems:
        raise HFCheckpointError(f"{path}: " + " ".join(p.engine_message() for p in problems))  # error-catalogue: passes on a message catalogued where it is built
    return data


def read_hf_tensors(folder: str | Path, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (by the index when there is one); with ``dequantize``
    (the default) quantised weights come back dequantised and their ``.scale`` tensors consumed."""
    from safetensors.torch import load_file

    from .hf_dequant import dequantize_tensors

    fmt = _format(folder) if dequantize else None  # an unread quantisation is refused before any tensor is read
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    paths = [folder / f for f in files] if files else sorted(folder.glob("*.safetensors"))
    if not paths:
        raise HFCheckpointError(f"{folder} has no *.safetensors files.")
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        for name, tensor in load_file(str(path)).items():
            if name in tensors:
                raise HFCheckpointError(f"tensor {name!r} appears in more than one safetensors file of {folder}.")
            tensors[name] = tensor
    if fmt is None:
        return tensors
    try:
        return dequantize_tensors(tensors, fmt)
    except CheckpointFormatError as e:
        raise HFCheckpointError(str(e)) from e


def _format(folder):
    """The folder's :class:`~.checkpoint_format.CheckpointFormat`, refused (as :class:`HFCheckpointError`) when
    the CPU loader does not read its quantisation."""
    try:
        fmt = read_checkpoint_format(folder) if (Path(folder) / "config.json").is_file() else checkpoint_format_from({}, source=str(folder))
        check_cpu_readable(fmt)
    except CheckpointFormatError as e:
        raise HFCheckpointError(str(e)) from e
    return fmt


def _expected_shapes(group, ours: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    shapes = [tuple(ours[n].shape) for n in group.ours]
    if group.kind == "copy":
        return shapes
    if group.kind == "cat":
        rows, *rest = shapes[0]
        return [(rows // len(group.files), *rest)] * len(group.files)
    return [(sum(s[0] for s in shapes), *shapes[0][1:])]


def load_into(model, tensors: dict[str, torch.Tensor], *, allow_mtp_skip: bool = False, folder=None) -> CheckpointInfo:
    """Check ``tensors`` (file names) against ``model`` and copy them in; returns the :class:`CheckpointInfo`."""
    ours = dict(model.state_dict(keep_vars=True))
    family = detect_family(tensors)
    groups = name_groups(model.config, family, tied_embeddings=model.share_embeddings_and_output_weights)
    wanted = {f for g in groups for f in g.files}
    skipped = sorted(
        n for n in tensors if allow_mtp_skip and n not in wanted and (n.startswith("mtp.") or n.startswith("model.mtp."))
    )
    problems = [f"missing tensor {f!r}" for f in sorted(wanted - set(tensors))]
    problems += [f"unexpected tensor {n!r} {tuple(tensors[n].shape)}" for n in sorted(set(tensors) - wanted - set(skipped))]
    for group in groups:
        for name, shape in zip(group.files, _expected_shapes(group, ours)):
            if name in tensors and tuple(tensors[name].shape) != shape:
                problems.append(f"tensor {name!r}: expected shape {shape}, found {tuple(tensors[name].shape)}")
    if problems:
        where = f" in {folder}" if folder else ""
        hint = "" if allow_mtp_skip or not any("mtp." in p for p in problems) else " (MTP tensors: pass allow_mtp_skip=True)"
        raise HFCheckpointError(f"The DS4 checkpoint{where} does not match its config ({family} names){hint}: " + "; ".join(problems) + ".")
    with torch.no_grad():
        for group in groups:
            src = [tensors[f] for f in group.files]
            if group.kind == "copy":
                parts = src
            elif group.kind == "cat":
                parts = [torch.cat(src, dim=0)]
            else:
                parts = list(src[0].chunk(len(group.ours), dim=0))
            for name, value in zip(group.ours, parts):
                target = ours[name]
                target.copy_(value.to(target.dtype))
    return CheckpointInfo(folder=Path(folder) if folder else None, family=family, dtypes={n: t.dtype for n, t in tensors.items()}, skipped=skipped)


def load_hf_checkpoint(folder: str | Path, dtype: torch.dtype = torch.float32, *, allow_mtp_skip: bool = False, **build_kwargs):
    """Build a :class:`~.model.DS4Model` from the folder's config and fill it: ``(model, info)``."""
    from .model import build_ds4_model

    config = read_config(folder)
    fmt = _format(folder)
    if fmt.drafter == "dspark" and fmt.mtp_layers > 0 and not allow_mtp_skip:
        raise HFCheckpointError(
            f"{folder} holds a DSpark drafter ({fmt.drafter_evidence}), not MTP layers, although "
            f"num_nextn_predict_layers={fmt.mtp_layers}: loading it as MTP would half-load it. Pass "
            "allow_mtp_skip=True (no MTP block; the drafter's tensors are skipped) or use a revision with MTP."
        )
    tensors = read_hf_tensors(folder)
    # quantization_config describes the files, not the model: the weights are dequantised by now
    storage_only = ("quantization_config", "expert_dtype")
    model = build_ds4_model({k: v for k, v in config.items() if k not in storage_only}, dtype=dtype,
                            allow_mtp_skip=allow_mtp_skip, **build_kwargs)
    info = load_into(model, tensors, allow_mtp_skip=allow_mtp_skip, folder=folder)
    return model, info


def hf_tensors_of(model, family: str = "transformers", dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under the file names of ``family`` (dtype per name from ``dtypes``, else fp32
    for floating tensors)."""
    ours = model.state_dict()
    out = {}
    for group in name_groups(model.config, family, tied_embeddings=model.share_embeddings_and_output_weights):
        values = [ours[n] for n in group.ours]
        if group.kind == "copy":
            parts = values
        elif group.kind == "cat":
            parts = list(values[0].chunk(len(group.files), dim=0))
        else:
            parts = [torch.cat(values, dim=0)]
        for name, value in zip(group.files, parts):
            want = (dtypes or {}).get(name, torch.float32 if value.is_floating_point() else value.dtype)
            out[name] = value.detach().to(want).contiguous().clone()
    return out


def save_hf_checkpoint(model, folder: str | Path, info: CheckpointInfo | None = None, *, family: str | None = None, config: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors``: the names / dtypes of ``info`` (the load's), or ``family``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = family or (info.family if info else "transformers")
    tensors = hf_tensors_of(model, family, info.dtypes if info else None)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    elif info is not None and info.folder is not None and (info.folder / "config.json").resolve() != (folder / "config.json").resolve():
        source = json.loads((info.folder / "config.json").read_text())
        if "quantization_config" in source or "expert_dtype" in source:  # the tensors written are dequantised
            kept = {k: v for k, v in source.items() if k not in ("quantization_config", "expert_dtype")}
            (folder / "config.json").write_text(json.dumps(kept, indent=2, sort_keys=True))
        else:
            shutil.copyfile(info.folder / "config.json", folder / "config.json")
    return folder
