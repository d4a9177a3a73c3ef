"""The RL resume check (verl_ds4.recipes.resume_check): a checkpoint is resumed only by the run that wrote it.

Unit level, no Ray: a config like the CPU PPO recipe's, a checkpoint folder laid out as verl's trainer
leaves it (``latest_checkpointed_iteration.txt``, ``global_step_N``) and the record the callback writes.
Each changed field (CP size, a model-config field, the training data) is refused with its old and new
value and the fix; the unchanged run, a fresh start and ``resume_mode=disable`` are accepted. The
end-to-end refusal through the launcher is in tests/test_cpu_ppo_on_cpu.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_ds4.recipes.resume_check import (
    RECORD_NAME,
    ResumeMismatchError,
    RunRecordCallback,
    check_resume,
    diff_identities,
    main,
    run_identity,
)

CP_KEY = "actor_rollout_ref.actor.megatron.context_parallel_size"


def _assets(root: Path, layers: int = 2, rows: bytes = b"rows-v1") -> tuple[Path, Path]:
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": layers}))
    data = root / "train.parquet"
    data.write_bytes(rows)
    return model, data


def _config(tmp_path: Path, *, cp: int = 2, layers: int = 2, rows: bytes = b"rows-v1", resume_mode: str = "auto"):
    model, data = _assets(tmp_path / f"assets_{layers}_{rows.decode()}", layers, rows)
    megatron = {"context_parallel_size": cp, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "model": {"path": str(model)},
                "actor": {"megatron": dict(megatron)},
                "ref": {"megatron": dict(megatron)},
            },
            "critic": {"enable": None, "model": {"path": str(model)}, "megatron": dict(megatron)},
            "data": {"train_files": str(data), "train_batch_size": 4, "seed": 1, "shuffle": True},
            "reward": {"custom_reward_function": {"path": "demo_task.py", "name": "compute_score"}},
            "trainer": {
                "nnodes": 1,
                "n_gpus_per_node": 2,
                "resume_mode": resume_mode,
                "resume_from_path": None,
                "default_local_dir": str(tmp_path / "checkpoints"),
            },
        }
    )


def _checkpoint(tmp_path: Path, config, step: int = 2) -> Path:
    """What a run of ``config`` leaves: the callback's records and verl's tracker + step folder."""
    callback = RunRecordCallback(config)  # a fresh start: writes the run's record
    folder = tmp_path / "checkpoints" / f"global_step_{step}"
    folder.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(step))
    callback.on_save(trainer=None, global_step=step, checkpoint_dir=str(folder))
    return folder


def test_the_same_run_resumes_and_a_fresh_start_is_not_checked(tmp_path):
    config = _config(tmp_path)
    assert check_resume(config) is None  # no tracker: a fresh start
    folder = _checkpoint(tmp_path, config)
    assert json.loads((folder / RECORD_NAME).read_text())["global_step"] == 2
    assert check_resume(_config(tmp_path)) == folder
    RunRecordCallback(_config(tmp_path))  # the trainer's start-up check accepts it too


@pytest.mark.parametrize(
    "change, field, old, new",
    [
        ({"cp": 1}, CP_KEY, "2", "1"),
        ({"layers": 3}, "model config (actor_rollout_ref.model.path/config.json).num_hidden_layers", "2", "3"),
        ({"rows": b"rows-v2"}, "training data (sha256 of data.train_files)", None, None),
    ],
    ids=["cp", "model-config", "data"],
)
def test_a_changed_cp_model_config_or_data_is_refused_naming_the_field(tmp_path, change, field, old, new):
    _checkpoint(tmp_path, _config(tmp_path))
    changed = _config(tmp_path, **change)
    with pytest.raises(ResumeMismatchError) as err:
        check_resume(changed)
    message = str(err.value)
    assert "refusing to resume from" in message and "global_step_2" in message
    [line] = [line for line in message.splitlines() if line.startswith(f"  - {field}")]
    if old is not None:
        assert line == f"  - {field}: checkpoint {old}, now {new}", line
    assert "WORK_DIR" in message and "RESUME_MODE=disable" in message
    with pytest.raises(ResumeMismatchError):
        RunRecordCallback(changed)  # the trainer refuses at construction as well
    # Negative control: resume_mode=disable starts fresh, nothing to compare.
    assert check_resume(_config(tmp_path, resume_mode="disable", **change)) is None


def test_a_checkpoint_without_a_record_is_refused(tmp_path):
    config = _config(tmp_path)
    folder = tmp_path / "checkpoints" / "global_step_1"
    folder.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(ResumeMismatchError, match=f"it has no {RECORD_NAME}"):
        check_resume(config)
    # The start-up record in default_local_dir covers a run killed between verl's tracker and the callback.
    RunRecordCallback(_config(tmp_path, resume_mode="disable"))
    assert check_resume(config) == folder


def test_diff_names_nested_fields_and_missing_ones():
    old = {"a": 1, "m": {"x": 1, "y": [1, 2]}}
    assert diff_identities(old, {"a": 1, "m": {"x": 1, "y": [1, 2]}}) == []
    assert diff_identities(old, {"a": 2, "m": {"x": 1, "y": [1, 3], "z": 0}}) == [
        ("a", 1, 2), ("m.y", [1, 2], [1, 3]), ("m.z", "<not set>", 0)
    ]


def test_identity_reads_contents_not_paths(tmp_path):
    one = run_identity(_config(tmp_path / "one"))
    two = run_identity(_config(tmp_path / "two"))  # same contents in other folders
    assert diff_identities(one, two) == []
    assert one[CP_KEY] == 2 and one["critic.megatron.context_parallel_size"] == 2


def test_the_launchers_preflight_composes_the_recipe_and_refuses(tmp_path, capsys):
    """``python -m verl_ds4.recipes.resume_check ppo -- OVERRIDES`` on the real CPU PPO recipe."""
    model, data = _assets(tmp_path / "assets")
    ckpt = tmp_path / "checkpoints"
    base = [
        "hydra.searchpath=[pkg://verl_ds4.recipes_data,pkg://verl_ds4.configs_data]",
        "+recipe=ds4_proxy_ppo_cpu",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={ckpt}",
        "trainer.resume_mode=auto",
    ]
    assert main(["ppo", *base]) == 0 and "a fresh start" in capsys.readouterr().out
    from verl_ds4.recipes.compose import compose_recipe

    config = compose_recipe("ppo", base)
    assert config.trainer.checkpoint_callback_class == "verl_ds4.recipes.resume_check.RunRecordCallback"
    assert config.actor_rollout_ref.rollout.full_determinism is True
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "ds4_seeded_single_turn"  # one seed per response
    _checkpoint(tmp_path, config, step=1)
    assert main(["ppo", *base]) == 0 and "global_step_1" in capsys.readouterr().out
    assert main(["ppo", *base, "critic.megatron.context_parallel_size=1"]) == 2
    assert "  - critic.megatron.context_parallel_size: checkpoint 2, now 1" in capsys.readouterr().err
