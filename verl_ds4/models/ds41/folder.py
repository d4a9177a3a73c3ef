"""A V4.1 model folder in our own names: ``config.json`` + ``model.safetensors`` + the tokenizer.

    save_folder(model, folder, config, tokenizer)      # config: the config.json dict (model_type deepseek_v41)
    model = load_folder(folder, dtype=torch.float64)    # DS41Model, Engram table from the folder's tokenizer

Everything the folder must satisfy is checked before a weight is read (:func:`read_folder_config`):
``model_type`` (a V4 folder is refused with the fix), every ``ds41_facts`` rule, and for Engram the
tokenizer whose normalisation tables it hashes with (``tokenizer.json``). Tensors carry our names
(:class:`~.model.DS41Model`'s state dict). :func:`load_folder` also reads DeepSeek's released on-disk
names with their FP8 / FP4 weights, and NeMo Automodel's names (:mod:`.released`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from verl_ds4 import ds41_facts

__all__ = ["read_folder_config", "save_folder", "load_folder"]

WEIGHTS = "model.safetensors"


def read_folder_config(folder: str | Path) -> dict:
    """``config.json`` of a V4.1 folder, refused (``ValueError`` with every field and fix) unless it is one."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: expected a DeepSeek-V4.1 folder (config.json, {WEIGHTS}, tokenizer.json).")
    config = json.loads(path.read_text())
    ds41_facts.read_config(config, tokenizer_files=[p.name for p in folder.iterdir()])
    return config


def save_folder(model, folder: str | Path, config: dict, tokenizer: Any = None) -> Path:
    """Write ``model`` (a :class:`~.model.DS41Model`) with ``config`` (checked first) and ``tokenizer``."""
    from safetensors.torch import save_file

    ds41_facts.read_config(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(folder / WEIGHTS))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    read_folder_config(folder)  # what a loader will ask of it
    return folder


def load_folder(folder: str | Path, dtype: torch.dtype = torch.float32, cache_qdq: bool = False):
    """A :class:`~.model.DS41Model` from ``folder``; every tensor must be there with its shape."""
    from .engram import engram_token_map
    from .model import DS41Model
    from .released import read_folder_tensors

    folder = Path(folder)
    config = read_folder_config(folder)
    table = None
    if ds41_facts.read_config(config).engram_layers:
        from transformers import PreTrainedTokenizerFast

        table = engram_token_map(PreTrainedTokenizerFast(tokenizer_file=str(folder / ds41_facts.TOKENIZER_FILE)))[0]
    model = DS41Model(config, table, dtype=dtype, cache_qdq=cache_qdq)
    tensors, style, skipped = read_folder_tensors(folder, config)
    if skipped:
        print(f"[verl-ds4] {folder}: {style} names; not loaded (the text model does not build them): "
              + ", ".join(f"{n} {what}" for what, n in skipped.items()), file=sys.stderr)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors) if tensors[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"{folder} does not fit its config.json: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {[(k, tuple(tensors[k].shape), tuple(expected[k].shape)) for k in wrong[:5]]}. "
            "Write the folder with save_folder from the same config."
        )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()})
    return model
