"""Megatron-Bridge's HF -> Megatron -> HF round trip of a DeepSeek-V4 folder, on the production model.

    model = ProductionBuilder(folder)(1)                      # Bridge's import (verl_ds4.verify.production)
    exported = export_tensors(folder, model)                  # Bridge's own export: AutoBridge.export_hf_weights
    diff = compare_tensors(exported, stored_tensors(folder))  # names, dtypes and values, bit for bit

Bridge 0.6.2 offers ``AutoBridge.export_hf_weights`` (a stream of ``(hf_name, tensor)``) and
``save_hf_pretrained`` / ``save_hf_weights``; the latter two import NVIDIA ModelOpt
(``modelopt.torch.quantization``) even for an unquantised model, which the CPU environments do not have, so the
round trip takes the stream. For a folder in the hub's FP8 / FP4 form the stream is what Bridge would write: its DS4
bridge re-quantises every ``X.weight`` that has an ``X.scale`` in the source folder, with the source's scale layout.

Runs in a process whose ``megatron`` is Megatron-LM ``dev`` (:func:`verl_ds4.substitutes.megatron_dev.use`), on an
initialised Megatron parallel state (as :class:`~verl_ds4.verify.production.ProductionBuilder` needs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["TensorDiff", "compare_parameters", "compare_tensors", "dequantised", "export_tensors", "parameters_of", "stored_tensors"]


def stored_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files as stored (no dequantisation), by the index when there is one."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    paths = [folder / f for f in files] if files else sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        out.update(load_file(str(path)))
    return out


def _gpt(model):
    """The Megatron ``GPTModel`` of a :class:`~verl_ds4.verify.production.ProductionLM` (or the model itself)."""
    return getattr(model, "gpt", model)


def export_tensors(folder: str | Path, model) -> dict[str, torch.Tensor]:
    """Bridge's export of ``model`` (built from ``folder``) as ``{hf_name: tensor}`` on the CPU. A name exported
    twice is an error (the stream must name each tensor once)."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(folder))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in bridge.export_hf_weights([_gpt(model)], cpu=True, show_progress=False):
        if name in out:
            raise ValueError(f"Bridge exported {name!r} twice")
        out[name] = tensor.detach().clone()
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (not a.numel() or torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _arithmetic(t: torch.Tensor) -> bool:
    """A dtype whose values can be compared after a widening cast (not the 1-byte float kinds: FP8, E8M0)."""
    return not (t.dtype.is_floating_point and t.dtype.itemsize == 1)


def _values_equal(a: torch.Tensor, b: torch.Tensor, numeric: bool = False) -> bool:
    if a.dtype == b.dtype and not (numeric and _arithmetic(a)):
        return _bits_equal(a, b)
    if not (_arithmetic(a) and _arithmetic(b)) or a.shape != b.shape:
        return False
    wide = torch.float64 if (a.dtype.is_floating_point or b.dtype.is_floating_point) else torch.int64
    return torch.equal(a.to(wide), b.to(wide))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not (_arithmetic(a) and _arithmetic(b)):
        return float("nan")
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0


@dataclass
class TensorDiff:
    """What differs between two ``{name: tensor}`` maps: names on one side only, dtypes, values."""

    only_exported: list[str] = field(default_factory=list)
    only_stored: list[str] = field(default_factory=list)
    dtype: dict[str, str] = field(default_factory=dict)  # name -> "exported dtype != stored dtype"
    values: dict[str, float] = field(default_factory=dict)  # name -> max |a - b| (inf: shapes differ; nan: FP8 bytes)
    compared: int = 0

    @property
    def equal(self) -> bool:
        """Names, dtypes and values: bit for bit."""
        return not (self.only_exported or self.only_stored or self.dtype or self.values)

    def to_dict(self) -> dict:
        return {"only_exported": self.only_exported, "only_stored": self.only_stored, "dtype": self.dtype,
                "values": self.values, "compared": self.compared, "equal": self.equal}


def compare_tensors(exported: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], *, numeric: bool = False) -> TensorDiff:
    """Name for name. Same dtype: bit for bit (``numeric``: as numbers, so -0.0 equals 0.0; FP8 / E8M0 still by their
    bytes). Different dtypes: the dtypes are recorded and the values compared exactly after a widening cast
    (float64 / int64); an FP8 / E8M0 tensor against another dtype is a value difference."""
    diff = TensorDiff(only_exported=sorted(set(exported) - set(stored)), only_stored=sorted(set(stored) - set(exported)))
    for name in sorted(set(exported) & set(stored)):
        a, b = exported[name], stored[name]
        diff.compared += 1
        if a.dtype != b.dtype:
            diff.dtype[name] = f"{a.dtype} != {b.dtype}"
        if not _values_equal(a, b, numeric):
            diff.values[name] = _max_abs(a, b)
    return diff


def dequantised(tensors: dict[str, torch.Tensor], folder: str | Path) -> dict[str, torch.Tensor]:
    """``tensors`` read as the folder's ``config.json`` declares (FP8 blocks, FP4 experts), by verl-ds4's reader:
    every quantised ``X.weight`` replaced by its exact value, its ``X.scale`` consumed."""
    from verl_ds4.models.ds4.checkpoint_format import read_checkpoint_format
    from verl_ds4.models.ds4.hf_dequant import dequantize_tensors

    return dequantize_tensors(dict(tensors), read_checkpoint_format(folder))


def parameters_of(model) -> dict[str, torch.Tensor]:
    """The loaded model's parameters and buffers by Megatron name (detached copies)."""
    gpt = _gpt(model)
    out = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in gpt.named_buffers()})
    return out


def compare_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> TensorDiff:
    """Two loads of the same architecture: every parameter and buffer bit-equal."""
    return compare_tensors(a, b)
