"""The DeepSeek-V4.1 GPU recipes (deepseek_v41_sft / deepseek_v41_grpo, ds4_model=v41_flash) on CPU: they
compose through verl's config tree, validate, print the plan with the memory table, and refuse bad V4.1
input at start-up with the field and the fix (verl_ds4/ds41_facts.py's rules, applied by the recipe
validator, `verl-ds4 recipe` and the launchers' --dry-run). ~15 s on 2 cores (each composition ~1 s).

Every refusal is a negative control of the valid baseline: the same command with one setting changed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from verl_ds4.ds41_facts import TEXT_DEFAULTS
from verl_ds4.recipes.compose import compose_recipe
from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

REPO = Path(__file__).resolve().parents[1]
TRAINER = {"deepseek_v41_sft": "sft", "deepseek_v41_grpo": "ppo"}


def validate(kind: str, overrides: list[str], dry_run: bool = True):
    cfg = compose_recipe(kind, overrides)
    return cfg, validate_recipe(cfg, TRAINER[kind], dry_run=dry_run)


def refused(kind: str, overrides: list[str]) -> str:
    with pytest.raises(RecipeValidationError) as info:
        validate(kind, overrides)
    return str(info.value)


def v41_config() -> dict:
    block = yaml.safe_load((files("verl_ds4.configs_data") / "ds4_model" / "v41_flash.yaml").read_text())
    text = {k: v for k, v in block.items() if k not in ("name", "hf_model_type")}
    # a folder's config.json gives its RoPE and norm settings (NeMo Automodel's save_pretrained writes them all);
    # the recipe's model block leaves them out, and a folder without them is refused (test_folders_as_written)
    written = {k: v for k, v in TEXT_DEFAULTS.items() if k not in text}
    return {"model_type": "deepseek_v41", "text_config": {**written, **text, "model_type": "deepseek_v41_text"}}


def cli(*args: str) -> tuple[int, str, str]:
    from verl_ds4.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("kind", sorted(TRAINER))
def test_v41_recipes_compose_validate_and_print_the_memory_table(kind):
    rc, out, err = cli("recipe", kind, "--dry-run")
    assert rc == 0, err
    assert "DeepSeek-V4.1-Flash: 40 layers + 0 MTP, 384 routed experts" in out and ">= 128 rows per CP rank" in out
    assert "Engram on layers [1, 14] (196.61B table parameters, split over EP" in out and "748.49B parameters" in out
    assert "validation: OK (0 errors" in out
    # the default meshes (h200_384gpu_pp1_ep192_cp2 for SFT, gb300_128gpu_pp1_ep128_cp2 for GRPO): the update's
    # states and peak, and the row says it fits (peak within the GPU less the headroom)
    # (the H200 mesh runs the linear sparse attention at 8192 tokens per GPU)
    role, states, peak = ("sft", "89.7", "114.1") if kind.endswith("sft") else ("actor", "144.0", "151.6")
    assert any(line.split()[:2] == [role, "update"] and states in line.split() and peak in line.split()
               and line.rstrip().endswith("yes") for line in out.splitlines()), out
    cfg, report = validate(kind, [])
    engine = cfg.engine if kind.endswith("sft") else cfg.actor_rollout_ref.actor.megatron
    assert engine.override_transformer_config.cp_partition_mode == "contiguous" and engine.context_parallel_size == 2
    assert engine.tensor_model_parallel_size == 1 and all(not r.mtp for r in report.roles)
    assert report.facts.family == "ds41" and report.facts.violations == ()


@pytest.mark.parametrize(
    "override, field, expected, fix",
    [
        ("ds4.mtp=true", "model.mtp.enable", "DSpark drafter", "set ds4.mtp=false"),
        # a source-layer id pointing at a later layer: layer 2 has no KV source at or before it
        ("ds4.model.kv_source_layer_ids=[3,8,14,20]", "ds4.model.kv_source_layer_ids", "the first, layer 3, comes later",
         "Add layer 2"),
        # a source layer without the compressed state its readers need (layer 0 is window-only)
        ("ds4.model.kv_source_layer_ids=[0,2,8,14,20]", "ds4.model.kv_source_layer_ids", "layers [0] are window-only",
         "Remove them from kv_source_layer_ids"),
        ("ds4.model.candidate_source_layer_id=24", "ds4.model.candidate_source_layer_id", "layer 24 is not a Full layer",
         "Point it at a layer in kv_source_layer_ids"),
        ("ds4.model.engram_num_embeddings=[1000,384016682]", "ds4.model.engram_num_embeddings", "need 384006168 rows",
         "table sizes"),
        ("ds4.cp_partition_mode=zigzag", "engine.override_transformer_config.cp_partition_mode", "DeepSeek-V4.1",
         "cp_partition_mode=contiguous"),
        ("ds4.mesh.tp=2", "engine.tensor_model_parallel_size", "tensor parallelism", "tensor_model_parallel_size=1"),
    ],
)
def test_bad_v41_input_is_refused_with_field_and_fix(override, field, expected, fix):
    text = refused("deepseek_v41_sft", [override])
    line = next(line for line in text.splitlines() if field + ":" in line)
    assert expected in line and "Fix: " in line and fix in line.split("Fix: ", 1)[1], line


def test_dspark_refusal_holds_for_grpo_too():
    text = refused("deepseek_v41_grpo", ["ds4.mtp=true"])
    assert "actor_rollout_ref.model.mtp.enable: is True" in text and "set ds4.mtp=false" in text


def test_a_local_folder_is_checked_with_its_files(tmp_path):
    folder = tmp_path / "v41"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(v41_config()))
    text = refused("deepseek_v41_sft", [f"model.path={folder}"])
    assert f"model.path ({folder}/config.json) tokenizer.json" in text and "Copy the checkpoint's tokenizer.json" in text
    (folder / "tokenizer.json").write_text("{}")
    _, report = validate("deepseek_v41_sft", [f"model.path={folder}"])
    assert report.errors == [] and report.facts.source == f"{folder}/config.json"
    # the folder's numbers win over the recipe's: a broken schedule in config.json is refused
    bad = v41_config()
    bad["text_config"]["kv_source_layer_ids"] = [3, 8, 14, 20]
    (folder / "config.json").write_text(json.dumps(bad))
    assert "comes later" in refused("deepseek_v41_sft", [f"model.path={folder}"])


def test_v4_folder_under_the_v41_recipe_and_v41_folder_under_the_v4_recipe_are_refused(tmp_path):
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 43}))
    text = refused("deepseek_v41_sft", [f"model.path={v4}"])
    assert "model_type: is 'deepseek_v4'" in text and "a DeepSeek-V4 checkpoint" in text
    v41 = tmp_path / "v41"
    v41.mkdir()
    (v41 / "config.json").write_text(json.dumps(v41_config()))
    (v41 / "tokenizer.json").write_text("{}")
    with pytest.raises(RecipeValidationError, match="DeepSeek-V4.1 checkpoint"):
        validate_recipe(compose_recipe("sft", [f"model.path={v41}"]), "sft", dry_run=True)


@pytest.mark.parametrize("script, recipe", [("run_deepseek_v4_flash_sft_megatron.sh", "deepseek_v41_sft"),
                                            ("run_deepseek_v4_flash_grpo_megatron.sh", "deepseek_v41_grpo")])
def test_launchers_select_v41_with_model_version(script, recipe):
    env = {k: v for k, v in os.environ.items() if k not in ("MESH", "MODEL_PATH", "MTP", "PROJECT_NAME", "EXP_NAME")}
    env.update(PYTHON=sys.executable, MODEL_VERSION="v41")
    run = subprocess.run(["bash", f"scripts/{script}", "--dry-run"], capture_output=True, text=True, cwd=REPO, env=env)
    assert run.returncode == 0, run.stderr
    assert "DeepSeek-V4.1-Flash" in run.stdout and "validation: OK" in run.stdout
    bad = subprocess.run(["bash", f"scripts/{script}", "--dry-run", "ds4.mtp=true"], capture_output=True, text=True,
                         cwd=REPO, env=env)
    assert bad.returncode == 1 and "set ds4.mtp=false" in bad.stdout + bad.stderr
    env["MODEL_VERSION"] = "v5"
    assert subprocess.run(["bash", f"scripts/{script}", "--dry-run"], capture_output=True, text=True, cwd=REPO,
                          env=env).returncode == 2


def test_plan_fit_reads_a_v41_folder_like_the_model_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_config()))
    args = ("plan", "--fit", "--gpu", "GB300", "--gpus", "96", "--recipe", "grpo", "--json")
    rc, folder, _ = cli(*args, "--model", str(tmp_path))
    assert rc == 0 and json.loads(folder)["meshes"] == json.loads(cli(*args, "--model", "v41_flash")[1])["meshes"]
    bad = v41_config()
    bad["text_config"]["kv_source_layer_ids"] = [3, 8, 14, 20]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    rc, _, err = cli(*args, "--model", str(tmp_path))
    assert rc == 2 and "kv_source_layer_ids=[3, 8, 14, 20]" in err and "comes later" in err
