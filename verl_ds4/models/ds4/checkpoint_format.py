"""What an HF DeepSeek-V4 folder holds, read from ``config.json`` and the tensor names alone.

    fmt = read_checkpoint_format("path/to/DeepSeek-V4-Flash")
    fmt.describe()          # "FP8 e4m3 weights, 128x128 block scales (ue8m0); routed experts FP4 e2m1 ..."
    fmt.drafter             # "none" | "mtp" | "dspark"
    check_cpu_readable(fmt) # raises CheckpointFormatError for a format the CPU loader does not read

Pure (standard library only: no torch), so the recipe validator can call it on a login node.
Tensor names come from ``model.safetensors.index.json`` when present, else from the JSON header of
each ``*.safetensors`` file (no tensor is read).

The hub's on-disk formats (docs/ds4-context-parallel.md section 11):

* ``quantization_config: {quant_method: fp8, fmt: e4m3, scale_fmt: ue8m0, weight_block_size:
  [128, 128], activation_scheme: dynamic}``: FP8 E4M3 weights, one power-of-two (UE8M0) scale per
  128 x 128 block, stored as ``<name>.scale`` beside ``<name>.weight``;
* ``expert_dtype: fp4`` (top level, or inside ``quantization_config`` from transformers 5.25 on):
  routed experts FP4 E2M1, two per byte, one E8M0 scale per 32 inputs (MXFP4 style); Base
  checkpoints have FP8 experts;
* no ``quantization_config``: plain floating weights (``torch_dtype`` / ``dtype``, usually bf16).

Drafters: ``num_nextn_predict_layers > 0`` declares MTP (``mtp.k.{enorm,hnorm,e_proj,h_proj}``).
The revisions Flash-0731 / Pro-0813 instead keep a DSpark drafter under the same ``mtp.k.*``
prefix (a ``markov_head``, no ``enorm`` / ``hnorm`` / ``eh_proj``; config keys
``dspark_block_size``, ``dspark_target_layer_ids``) while ``num_nextn_predict_layers`` still says
1. It is recognised by a ``dspark_*`` config key, a ``mtp.k.markov_head`` tensor, or ``mtp.*``
tensors without any ``enorm``; it must never be loaded as MTP.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "CheckpointFormatError", "CheckpointFormat", "read_checkpoint_format", "checkpoint_format_from",
    "check_cpu_readable", "tensor_names", "CPU_READS", "FP4_GROUP",
]

#: What :mod:`.hf_dequant` (the CPU loader) reads: the hub's FP8 format, any 2-D block size.
CPU_READS = {"quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("ue8m0",),
             "activation_scheme": ("dynamic",), "expert_dtype": ("fp4", "fp8")}
#: Inputs sharing one E8M0 scale in an FP4 expert weight (MXFP4's group).
FP4_GROUP = 32
_MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")


class CheckpointFormatError(ValueError):
    """A checkpoint format this code does not read (or a folder it cannot inspect)."""


@dataclass(frozen=True)
class CheckpointFormat:
    """The storage format and the drafter of one checkpoint.

    Attributes:
        source: the ``config.json`` read.
        dtype: the config's ``torch_dtype`` / ``dtype`` (None when absent).
        quantization: the ``quantization_config`` dict (None: not quantised).
        expert_dtype: ``"fp4"`` / ``"fp8"`` / another string from the config, None when not stated.
        mtp_layers: the config's ``num_nextn_predict_layers``.
        drafter: ``"none"``, ``"mtp"`` or ``"dspark"``.
        drafter_evidence: why ``drafter`` was decided (config key, tensor name), for messages.
        names_read: where the tensor names came from (None: no names were available).
        mtp_tensors: whether any ``mtp.*`` tensor exists (None: no names were available).
    """

    source: str
    dtype: str | None
    quantization: Mapping[str, Any] | None
    expert_dtype: str | None
    mtp_layers: int
    drafter: str
    drafter_evidence: str
    names_read: str | None
    mtp_tensors: bool | None = None

    @property
    def quant_method(self) -> str | None:
        return None if self.quantization is None else str(self.quantization.get("quant_method"))

    @property
    def block_size(self) -> Any:
        """``weight_block_size`` as written (a valid one is two positive ints, rows x columns)."""
        return None if self.quantization is None else self.quantization.get("weight_block_size")

    @property
    def quantized(self) -> bool:
        return self.quantization is not None

    def describe(self) -> str:
        """One line: the weights' storage and the drafter."""
        q = self.quantization
        if q is None:
            weights = f"{self.dtype or 'unquantised (dtype not stated)'} weights (no quantization_config)"
        elif self.quant_method == "fp8":
            block = self.block_size
            grid = "x".join(str(b) for b in block) if isinstance(block, (list, tuple)) else repr(block)
            weights = f"FP8 {q.get('fmt', 'e4m3')} weights, {grid} block scales ({q.get('scale_fmt', 'float')})"
            if self.expert_dtype == "fp4":
                weights += f"; routed experts FP4 e2m1 (2 per byte, E8M0 scale per {FP4_GROUP} inputs)"
            elif self.expert_dtype not in (None, "fp8"):
                weights += f"; routed experts {self.expert_dtype}"
        else:
            weights = f"quantised with quant_method={self.quant_method!r}"
        missing = " declared, but the checkpoint has no mtp.* tensors" if self.mtp_tensors is False else ""
        drafter = {"none": "no MTP", "mtp": f"MTP ({self.mtp_layers} layer(s)){missing}",
                   "dspark": f"a DSpark drafter, not MTP ({self.drafter_evidence})"}[self.drafter]
        return f"{weights}; {drafter}"


def _safetensors_header_names(path: Path) -> list[str]:
    """Tensor names in one ``.safetensors`` file's header (8-byte little-endian length + JSON)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointFormatError(f"{path} is not a safetensors file (shorter than its 8-byte header length).")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (ValueError, MemoryError) as e:
            raise CheckpointFormatError(f"{path}: unreadable safetensors header ({e}).") from e
    return [n for n in header if n != "__metadata__"]


def tensor_names(folder: str | Path) -> tuple[list[str] | None, str | None]:
    """``(names, where from)``: the index's ``weight_map`` keys, else every safetensors header; ``(None, None)``
    when the folder has neither."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text())["weight_map"]), str(index)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{index}: expected JSON with a 'weight_map' object ({e}).") from e
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None, None
    return [n for p in files for n in _safetensors_header_names(p)], f"{len(files)} safetensors header(s)"


def _drafter(text: Mapping[str, Any], names: Iterable[str] | None, mtp_layers: int) -> tuple[str, str]:
    keys = sorted(k for k in text if str(k).startswith("dspark"))
    if keys:
        return "dspark", f"config keys {keys}"
    mtp = {m.group(2) for m in map(_MTP_NAME.match, names or ()) if m}
    markov = sorted(n for n in mtp if n.startswith("markov_head"))
    if markov:
        return "dspark", f"tensor mtp.N.{markov[0]}"
    if mtp and not any(n.startswith("enorm") for n in mtp):
        return "dspark", "mtp.* tensors without enorm / hnorm"
    if mtp_layers > 0:
        return "mtp", f"num_nextn_predict_layers={mtp_layers}"
    return "none", "num_nextn_predict_layers=0" if not mtp else "mtp.* tensors but num_nextn_predict_layers=0"


def checkpoint_format_from(config: Mapping[str, Any], names: Iterable[str] | None = None, source: str = "config.json",
                           names_read: str | None = None) -> CheckpointFormat:
    """The format of a checkpoint from its ``config.json`` dict and (optionally) its tensor names."""
    text = config.get("text_config") or config
    quant = config.get("quantization_config") or text.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise CheckpointFormatError(f"{source}: quantization_config is {quant!r}; expected an object.")
    expert = text.get("expert_dtype", config.get("expert_dtype"))
    if expert is None and quant is not None:
        expert = quant.get("expert_dtype")  # transformers >= 5.25 folds it in
    mtp_layers = int(text.get("num_nextn_predict_layers") or 0)
    names = None if names is None else list(names)
    drafter, evidence = _drafter(text, names, mtp_layers)
    dtype = text.get("torch_dtype", text.get("dtype"))
    return CheckpointFormat(
        source=source, dtype=None if dtype is None else str(dtype), quantization=dict(quant) if quant else None,
        expert_dtype=None if expert is None else str(expert).lower(), mtp_layers=mtp_layers,
        drafter=drafter, drafter_evidence=evidence, names_read=names_read,
        mtp_tensors=None if names is None else any(_MTP_NAME.match(n) for n in names),
    )


def read_checkpoint_format(folder: str | Path) -> CheckpointFormat:
    """The format of a local HF folder (``config.json`` + the index or safetensors headers)."""
    path = Path(folder).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"Cannot read {path}: {e}. Expected an HF DeepSeek-V4 folder's config.json.") from e
    names, where = tensor_names(path.parent)
    return checkpoint_format_from(config, names, source=str(path), names_read=where)


def _block_ok(block: Any) -> bool:
    return (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block))


def check_cpu_readable(fmt: CheckpointFormat) -> None:
    """Raise :class:`CheckpointFormatError` unless the CPU loader reads ``fmt``'s weights, naming what was
    found and what is read (:data:`CPU_READS`: the hub's FP8 e4m3 + ue8m0 block scales, FP4 or FP8
    experts; any block of two positive integers, 128 x 128 on the hub)."""
    q = fmt.quantization
    if q is None:
        return
    found = {"quant_method": fmt.quant_method, "fmt": q.get("fmt", "e4m3"), "scale_fmt": q.get("scale_fmt", "float"),
             "activation_scheme": q.get("activation_scheme", "dynamic"), "expert_dtype": fmt.expert_dtype or "fp8"}
    bad = [f"{k}={v!r} (read: {', '.join(CPU_READS[k])})" for k, v in found.items() if v not in CPU_READS[k]]
    if not _block_ok(fmt.block_size):
        bad.append(f"weight_block_size={fmt.block_size!r} (read: two positive integers, rows x columns, e.g. [128, 128])")
    if bad:
        raise CheckpointFormatError(
            f"{fmt.source}: the CPU loader does not read this quantised checkpoint: {'; '.join(bad)}. It reads the "
            "hub's DeepSeek-V4 format (quant_method fp8, fmt e4m3, scale_fmt ue8m0, weight_block_size [128, 128], "
            "activation_scheme dynamic; expert_dtype fp4 or fp8). Dequantise the folder to bf16 first, or convert it "
            "to that format."
        )
