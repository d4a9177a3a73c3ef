"""Refuse to resume an RL run from a checkpoint that a different run wrote.

verl's PPO trainer resumes (``trainer.resume_mode=auto`` / ``resume_path``) from whatever
``global_step_N`` folder the tracker names, whatever the run now looks like: a changed context
parallel size, model config or task would load a checkpoint into a run it does not belong to
(Megatron's sharded state, per-rank RNG streams, the dataloader's position in another dataset)
and train on silently. This module records what a run *is* and compares it at start-up:

* :func:`run_identity` - the fields of a (resolved) PPO config that a checkpoint depends on:
  the parallel sizes of actor, reference and critic, the trainer's device count, the model's
  ``config.json`` (actor and critic), and the task: the training files' contents, the batch size,
  the dataloader's seed and shuffle, the reward function.
* :func:`check_resume` - where verl will resume from (verl's own rule, :func:`find_latest_ckpt_path`),
  the record that run left there (:data:`RECORD_NAME` in the ``global_step_N`` folder, else in
  ``trainer.default_local_dir``) and a :class:`ResumeMismatchError` naming every changed field
  with its old and new value and the fix, or a missing record.
* :class:`RunRecordCallback` - verl's ``trainer.checkpoint_callback_class`` hook (built first
  thing in the trainer's ``__init__``, on the driver's task runner, before any worker starts):
  checks at construction, writes the record to ``default_local_dir`` at start-up and into every
  ``global_step_N`` folder the trainer saves, and starts the driver's watch of the cluster's Ray nodes
  (:mod:`verl_ds4.recipes.node_watch`: a lost node ends the driver, so that the launcher restarts the run).

Select it with ``trainer.checkpoint_callback_class=verl_ds4.recipes.resume_check.RunRecordCallback``
(the CPU and GPU RL recipes do).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from verl.trainer.ppo.checkpoint_callback import CheckpointCallback

from verl_ds4.ckpt_manifest import mark_manifests_since, write_manifest
from verl_ds4.engine.checkpoint import install_trainer_hook
from verl_ds4.recipes import node_watch

__all__ = [
    "RECORD_NAME",
    "ResumeMismatchError",
    "RunRecordCallback",
    "check_resume",
    "diff_identities",
    "resume_folder",
    "run_identity",
    "write_record",
]

RECORD_NAME = "verl_ds4_run.json"
RECORD_VERSION = 1

# (config path, what it is) of every parallel size a checkpoint's sharding and RNG streams depend on.
_PARALLEL_KEYS = tuple(
    f"{role}.megatron.{size}"
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
    for size in (
        "context_parallel_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
    )
) + ("trainer.nnodes", "trainer.n_gpus_per_node")

# The task: what the dataloader's saved position and the reward mean.
_TASK_KEYS = (
    "data.train_batch_size",
    "data.seed",
    "data.shuffle",
    "reward.custom_reward_function.path",
    "reward.custom_reward_function.name",
)


class ResumeMismatchError(ValueError):
    """The checkpoint to resume from was written by a run that differs from this one."""


def _select(config, key: str):
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=None)
    if value is not None and OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return value


def _model_config(path) -> Any:
    """The parsed ``config.json`` of a local model folder; for anything else, the path itself."""
    if path is None:
        return None
    config_json = Path(str(path)).expanduser() / "config.json"
    if config_json.is_file():
        return json.loads(config_json.read_text())
    return {"path (no local config.json)": str(path)}


def _file_digest(path) -> str:
    digest = hashlib.sha256()
    with open(Path(str(path)).expanduser(), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _train_files_digest(files) -> Any:
    if files is None:
        return None
    files = [files] if isinstance(files, str) else list(files)
    return [_file_digest(f) if Path(str(f)).expanduser().is_file() else f"{f} (not a local file)" for f in files]


def run_identity(config) -> dict[str, Any]:
    """The fields of the resolved trainer ``config`` that a checkpoint belongs to (JSON-able).

    Paths are not compared (the same files may move); the contents they name are: the model's
    ``config.json`` and a SHA-256 of each training file.
    """
    identity: dict[str, Any] = {key: _select(config, key) for key in _PARALLEL_KEYS}
    identity["model config (actor_rollout_ref.model.path/config.json)"] = _model_config(
        _select(config, "actor_rollout_ref.model.path")
    )
    if _select(config, "critic.enable") is not False and _select(config, "critic.model.path") is not None:
        identity["critic model config (critic.model.path/config.json)"] = _model_config(
            _select(config, "critic.model.path")
        )
    identity["training data (sha256 of data.train_files)"] = _train_files_digest(_select(config, "data.train_files"))
    identity.update({key: _select(config, key) for key in _TASK_KEYS})
    return identity


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key in sorted(value):
            out.update(_flatten(value[key], f"{prefix}.{key}"))
        return out or {prefix: {}}
    return {prefix: value}


_MISSING = "<not set>"


def diff_identities(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``[(field, old, new)]`` for every field (nested model-config keys spelled out) that differs."""
    flat_old = {k: v for key, value in old.items() for k, v in _flatten(value, key).items()}
    flat_new = {k: v for key, value in new.items() for k, v in _flatten(value, key).items()}
    return [
        (key, flat_old.get(key, _MISSING), flat_new.get(key, _MISSING))
        for key in sorted(set(flat_old) | set(flat_new))
        if flat_old.get(key, _MISSING) != flat_new.get(key, _MISSING)
    ]


def _local_dir(config) -> Path:
    folder = Path(str(_select(config, "trainer.default_local_dir")))
    return folder if folder.is_absolute() else Path(os.getcwd()) / folder


def resume_folder(config) -> Path | None:
    """The ``global_step_N`` folder verl's trainer will resume from (its own rule), or None."""
    mode = _select(config, "trainer.resume_mode")
    if mode == "auto":
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

        found = find_latest_ckpt_path(str(_local_dir(config)))
        return Path(found) if found else None
    if mode == "resume_path":
        path = Path(str(_select(config, "trainer.resume_from_path")))
        return path if path.is_absolute() else Path(os.getcwd()) / path
    return None


_FIX = (
    "Start a fresh run instead: a new work folder (WORK_DIR=..., i.e. trainer.default_local_dir) or "
    "RESUME_MODE=disable (trainer.resume_mode=disable, which overwrites the old checkpoints)"
)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def check_resume(config, identity: dict[str, Any] | None = None) -> Path | None:
    """Raise :class:`ResumeMismatchError` if verl would resume from a checkpoint of another run.

    Returns the folder it will resume from (None: a fresh start). ``identity`` defaults to
    :func:`run_identity` of ``config``.
    """
    folder = resume_folder(config)
    if folder is None:
        return None
    identity = run_identity(config) if identity is None else identity
    candidates = (folder / RECORD_NAME, _local_dir(config) / RECORD_NAME)
    record_path = next((path for path in candidates if path.is_file()), None)
    if record_path is None:
        raise ResumeMismatchError(
            f"verl-ds4: refusing to resume from {folder}: it has no {RECORD_NAME} (nor has {candidates[1].parent}), "
            "so nothing says which run wrote it (CP size, model config, task). It was written by a run without "
            "verl_ds4.recipes.resume_check.RunRecordCallback. " + _FIX + "."
        )
    recorded = json.loads(record_path.read_text()).get("identity", {})
    changes = diff_identities(recorded, identity)
    if changes:
        lines = "\n".join(f"  - {key}: checkpoint {_short(old)}, now {_short(new)}" for key, old, new in changes)
        raise ResumeMismatchError(
            f"verl-ds4: refusing to resume from {folder}: this run differs from the run that wrote it "
            f"({record_path}):\n{lines}\n"
            "Its state (model and optimizer shards, per-rank RNG streams, the dataloader's position) belongs to "
            "that run; loading it here would train on silently in a state no run of this config has. Set the "
            "field(s) back to the checkpoint's value(s), or " + _FIX[0].lower() + _FIX[1:] + "."
        )
    return folder


def write_record(folder: str | Path, identity: dict[str, Any], global_step: int | None = None) -> Path:
    """Write the run record (:data:`RECORD_NAME`) into ``folder`` (atomically)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RECORD_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(
        json.dumps({"version": RECORD_VERSION, "global_step": global_step, "identity": identity}, indent=1) + "\n"
    )
    os.replace(tmp, path)
    return path


def _current_step():
    from verl.utils.skip.skip_manager import SkipManager

    return getattr(SkipManager, "step", "?")


class RunRecordCallback(CheckpointCallback):
    """verl's checkpoint callback: refuse a mismatched resume at start-up; record the run at every save.

    Its constructor also wraps verl's ``PPOTrainer._save_checkpoint`` so that the tracker advances only after
    the step's manifest that :meth:`on_save` writes (:func:`verl_ds4.engine.checkpoint.install_trainer_hook`).
    """

    def __init__(self, config=None):
        super().__init__(config=config)
        self.identity = run_identity(config)
        folder = check_resume(config, self.identity)
        if folder is not None:
            print(f"[verl-ds4] resume check: {folder} was written by this run's config (CP, model, task); resuming")
        write_record(_local_dir(config), self.identity)
        # Every step saved from here on ends with a manifest (a later one without it is an unfinished save).
        resumed = folder.name.rsplit("_", 1)[-1] if folder is not None else ""
        mark_manifests_since(_local_dir(config), int(resumed) + 1 if resumed.isdigit() else 0)
        # verl writes the tracker before calling on_save: from here on it is advanced after the step's manifest.
        install_trainer_hook()
        # A Ray node of the run lost: end the driver instead of letting verl's trainer wait for ever (node_watch).
        node_watch.start(_current_step)

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        write_record(checkpoint_dir, self.identity, global_step)
        if not async_save:  # the step's manifest: data.pt, the record, and actor/ and critic/ (their own manifests)
            write_manifest(checkpoint_dir, global_step=global_step, written_by="verl-ds4 RunRecordCallback")


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_ds4.recipes.resume_check {ppo,grpo} -- OVERRIDES...``: the launchers' start-up check.

    Composes the recipe with the trainer's own override list (:func:`verl_ds4.recipes.compose.compose_recipe`)
    and runs :func:`check_resume` before Ray starts: exit 0 (a fresh start, or a resume of this run's
    checkpoint), exit 2 with the reason on a mismatch. The trainer's :class:`RunRecordCallback` makes
    the same check again (for runs started without a launcher).
    """
    import argparse
    import sys

    from verl_ds4.recipes.compose import compose_recipe

    parser = argparse.ArgumentParser(description="Refuse to resume from a checkpoint another run wrote.")
    parser.add_argument("kind", choices=("ppo", "grpo"))
    parser.add_argument("overrides", nargs="*", help="the trainer's Hydra overrides (after --)")
    args = parser.parse_args(argv)
    config = compose_recipe(args.kind, args.overrides)
    from verl_ds4.recipes.ckpt_resume import CheckpointDamagedError, choose_resume

    try:  # the checkpoint verl would load, against its manifest (auto: the newest intact one)
        checked = choose_resume(_local_dir(config), _select(config, "trainer.resume_mode") or "auto",
                                _select(config, "trainer.resume_from_path"))
    except CheckpointDamagedError as err:
        print(str(err), file=sys.stderr)
        return 2
    for message in checked.messages:
        print(message, file=sys.stderr)
    try:
        folder = check_resume(config)
    except ResumeMismatchError as err:
        print(str(err), file=sys.stderr)
        return 2
    print(f"resume: {folder}" if folder is not None else "resume: none (a fresh start)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
