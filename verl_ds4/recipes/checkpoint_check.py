"""The recipe validator's checkpoint-format rule: what each local model folder holds, and no MTP on a
DSpark drafter.

:func:`check_checkpoint_format` reads each local model folder's ``config.json`` and tensor names
(:mod:`verl_ds4.models.ds4.checkpoint_format`; no tensor is loaded) and adds to the report:

* a note describing the format: bf16, or the hub's FP8 e4m3 + UE8M0 block scales (and FP4 routed
  experts), which Megatron-Bridge dequantises on import;
* a warning for a quantisation DS4 checkpoints do not ship (``quant_method`` other than ``fp8``);
* an error when a DSpark drafter checkpoint (Flash-0731 / Pro-0813: ``mtp.*`` holds a drafter
  although ``num_nextn_predict_layers`` says 1) meets MTP on (``<model block>.mtp.enable``, the
  recipe knob ``ds4.mtp``), naming the setting and the fix.

Remote paths and folders without ``config.json`` are skipped (the path rule reports those).

:func:`check_async_save`: an RL role's ``checkpoint.async_save=true`` is an error (verl 0.9.1's RL trainers never
finalise async saves; the SFT recipes offer them as ``ds4.async_save``).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from verl_ds4.models.ds4.checkpoint_format import CheckpointFormatError, read_checkpoint_format
from verl_ds4.models.ds4.provider import local_config_json
from verl_ds4.recipes.roles import Problem, RoleMesh, _get

__all__ = ["check_async_save", "check_checkpoint_format", "check_ds41_checkpoint_format"]


def check_checkpoint_format(cfg: DictConfig, trainer: str, roles: list[RoleMesh], report: Any) -> None:
    """Add the format note, the foreign-quantisation warning and the DSpark-with-MTP error (see the module) to
    ``report`` (a :class:`verl_ds4.recipes.validate.ValidationReport`: its ``notes``, ``warnings``, ``errors``)."""
    for block in _model_blocks(trainer, roles):
        path = _get(cfg, f"{block}.path")
        if local_config_json(path) is None:
            continue
        try:
            fmt = read_checkpoint_format(os.path.expanduser(str(path)))
        except CheckpointFormatError as e:
            report.errors.append(Problem(f"{block}.path", str(e), "fix the file or point the path at another folder."))
            continue
        on_import = " Megatron-Bridge dequantises it on import (bf16 parameters)." if fmt.quantized else ""
        report.notes.append(f"{block}.path holds {fmt.describe()}.{on_import}")
        if fmt.quantized and fmt.quant_method != "fp8":
            report.warnings.append(Problem(
                f"{block}.path",
                f"is quantised with quant_method={fmt.quant_method!r}, not the FP8 format DS4 checkpoints ship "
                "(e4m3, ue8m0 128x128 block scales); verl-ds4's CPU loader refuses it.",
                "use a bf16 checkpoint or the hub's FP8 one.",
            ))
        if fmt.drafter == "dspark" and any(r.mtp and r.model_key == block for r in roles):
            report.errors.append(Problem(
                f"{block}.mtp.enable",
                f"is True, but {path} holds a DSpark drafter ({fmt.drafter_evidence}), not MTP layers "
                f"(although num_nextn_predict_layers={fmt.mtp_layers}); loading it as MTP would half-load it.",
                f"set ds4.mtp=false (or {block}.mtp.enable=false), or use a checkpoint revision with MTP layers.",
            ))


def check_ds41_checkpoint_format(cfg: DictConfig, trainer: str, roles: list[RoleMesh], report: Any) -> None:
    """A V4.1 recipe's local model folders: a note on what each holds (name style, FP8 / FP4, what the text
    model leaves out), or an error naming what a reader would refuse, from the safetensors headers
    (:func:`verl_ds4.models.ds41.released.describe_folder`). A folder without weights gets a note only."""
    import json
    from pathlib import Path

    from verl_ds4.models.ds41.released import describe_folder

    for block in _model_blocks(trainer, roles):
        path = _get(cfg, f"{block}.path")
        config_json = local_config_json(path)
        if config_json is None:
            continue
        folder = Path(config_json).parent
        if not any(folder.glob("*.safetensors")):
            report.notes.append(f"{block}.path has no *.safetensors yet: its tensor format is checked when weights are there.")
            continue
        try:
            report.notes.append(f"{block}.path holds {describe_folder(folder, json.loads(Path(config_json).read_text()))}.")
        except ValueError as e:
            report.errors.append(Problem(f"{block}.path", str(e), "fix the file or point the path at another folder."))


def check_async_save(cfg: DictConfig, trainer: str, report: Any) -> None:
    """Async saves are finalised in verl's SFT trainer only (:mod:`verl_ds4.engine.checkpoint`): an RL role's
    ``checkpoint.async_save=True`` would never get its metadata, manifest or tracker."""
    if trainer != "ppo":
        return
    for key in ("actor_rollout_ref.actor.checkpoint.async_save", "critic.checkpoint.async_save"):
        if bool(_get(cfg, key, False)):
            report.errors.append(Problem(
                key, "is True, but verl 0.9.1's PPO trainer and its Ray workers never finalise Megatron's async "
                "saves: no step would get its metadata, manifest or tracker and the run's last save would be lost.",
                "set it to false (async saves are offered for SFT: ds4.async_save=true in the SFT recipes)."))


def _model_blocks(trainer: str, roles: list[RoleMesh]) -> list[str]:
    blocks = ["model"] if trainer == "sft" else ["actor_rollout_ref.model"]
    return blocks + (["critic.model"] if any(r.role == "critic" for r in roles) else [])
