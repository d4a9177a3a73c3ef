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

__all__ = ["read_folder_config", "save_folder", "load_folder", "load_drafter", "token_table"]

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


def save_folder(model, folder: str | Path, config: dict, tokenizer: Any = None, names: str = "ours", drafter=None) -> Path:
    """Write ``model`` (a :class:`~.model.DS41Model` or ``DS41MegatronModel``) with ``config`` (checked first) and
    ``tokenizer``. ``names``: ``"ours"`` (``decoder.layers.*``, the default) or ``"released"`` (DeepSeek's
    on-disk names, what NeMo Automodel's adapter and vLLM-style readers take; unquantised, in the model's
    dtypes: NeMo exports trained weights unquantised too). ``drafter``: a :class:`~.dspark.DS41DSpark` written
    as the folder's ``mtp.*`` beside the model."""
    from safetensors.torch import save_file

    from .released import ours_to_released

    if names not in ("ours", "released"):
        raise ValueError(f"save_folder names={names!r}: expected 'ours' or 'released'.")  # error-catalogue: internal: a caller passed a bad argument
    ds41_facts.read_config(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if drafter is not None:
        state.update({k: v.detach() for k, v in drafter.state_dict().items()})
    if names == "released":
        state = ours_to_released(state)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    read_folder_config(folder)  # what a loader will ask of it
    return folder


def token_table(folder: Path, config: dict):
    if not ds41_facts.read_config(config).engram_layers:
        return None
    from transformers import PreTrainedTokenizerFast

    from .engram import engram_token_map

    return engram_token_map(PreTrainedTokenizerFast(tokenizer_file=str(folder / ds41_facts.TOKENIZER_FILE)))[0]


def _note(folder: Path, style: str, skipped: dict) -> None:
    if skipped:
        print(f"[verl-ds4] {folder}: {style} names; not loaded (the text model does not build them): "
              + ", ".join(f"{n} {what}" for what, n in skipped.items()), file=sys.stderr)


def load_folder(folder: str | Path, dtype: torch.dtype = torch.float32, cache_qdq: bool = False):
    """A :class:`~.model.DS41Model` from ``folder`` (our, DeepSeek's released or NeMo's names; FP8 / FP4
    decoded); every tensor must be there with its shape, checked on the safetensors headers before a weight
    is read. The drafter's ``mtp.*`` is counted on stderr, not loaded (:func:`load_drafter` reads it)."""
    from .model import DS41Model
    from .released import load_checked

    folder = Path(folder)
    config = read_folder_config(folder)
    model = DS41Model(config, token_table(folder, config), dtype=dtype, cache_qdq=cache_qdq)
    style, skipped = load_checked(model, folder, config)
    _note(folder, style, skipped)
    return model


def load_drafter(folder: str | Path, dtype: torch.dtype = torch.float32, cache_qdq: bool = False):
    """The folder's DSpark drafter (``mtp.*``, released or our names) as a :class:`~.dspark.DS41DSpark`,
    checked like :func:`load_folder`; a config without a drafter is refused."""
    from .dspark import DS41DSpark
    from .released import load_checked

    folder = Path(folder)
    config = read_folder_config(folder)
    if not ds41_facts.has_dspark(config):
        raise ValueError(f"{folder}/config.json describes no DSpark drafter (num_nextn_predict_layers > 0 with dspark_* "
                         "keys): there is no mtp.* to load. Load the model with load_folder.")
    drafter = DS41DSpark(config, dtype=dtype, cache_qdq=cache_qdq)
    load_checked(drafter, folder, config, part="drafter")
    return drafter
