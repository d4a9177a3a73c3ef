"""``ds4.max_seq_len``: the longest sequence as one recipe input (verl_ds4/recipes/seq_len.py).

The derivations (SFT ``data.max_length``; RL prompt / response split, vLLM's ``max_model_len``; the token budgets),
a user's explicit lengths kept and checked, the refusal above ``max_position_embeddings``, and the launchers'
``MAX_SEQ_LEN``; each with a negative control. Seconds on CPU (a few Hydra compositions, two launcher dry-runs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_ds4.models.ds4.provider import DS4ModelFacts
from verl_ds4.recipes import seq_len
from verl_ds4.recipes.compose import compose_recipe, derived_length_overrides
from verl_ds4.recipes.validate import validate_recipe

REPO = Path(__file__).resolve().parents[1]
CP8 = "ds4_mesh=h200_64gpu_pp4_ep16_cp8"


def _rl(n=None, prompt=1024, response=2048, model_len=None, cp=2, budget=8192):
    return {"ds4": {"max_seq_len": n, "mesh": {"cp": cp}, "max_token_len_per_gpu": budget, "infer_max_token_len_per_gpu": 2 * budget},
            "data": {"max_prompt_length": prompt, "max_response_length": response},
            "actor_rollout_ref": {"rollout": {"max_model_len": model_len}}}


# ------------------------------------------------------------------ derivations (pure)

def test_split_is_a_quarter_capped_and_keeps_a_given_side():
    assert seq_len.split_lengths(4096) == (1024, 3072)
    assert seq_len.split_lengths(32768) == (8192, 24576)
    assert seq_len.split_lengths(131072) == (8192, 122880)  # the prompt's cap
    assert seq_len.split_lengths(32768, prompt=2048) == (2048, 30720)
    assert seq_len.split_lengths(32768, response=30000) == (2768, 30000)


def test_derived_overrides_rl_and_sft():
    rl = seq_len.derived_overrides(_rl(n=65536), "ppo", [])
    assert rl == ["data.max_prompt_length=8192", "data.max_response_length=57344",
                  "actor_rollout_ref.rollout.max_model_len=65536",
                  "ds4.max_token_len_per_gpu=32768", "ds4.infer_max_token_len_per_gpu=32768"]  # both x CP2 < 65536
    sft = seq_len.derived_overrides({"ds4": {"max_seq_len": 32768, "mesh": {"cp": 8}, "max_token_len_per_gpu": 4096}}, "sft", [])
    assert sft == ["data.max_length=32768"]  # 4096 x CP8 holds it: the budget stays the mesh's
    # negative control: null derives nothing (today's lengths stand)
    assert seq_len.derived_overrides(_rl(), "ppo", []) == []


def test_budgets_rise_only_when_budget_x_cp_is_short():
    out = seq_len.derived_overrides(_rl(n=131072, budget=8192), "ppo", [])
    assert "ds4.max_token_len_per_gpu=65536" in out and "ds4.infer_max_token_len_per_gpu=65536" in out
    out = seq_len.derived_overrides(_rl(n=16384, budget=8192), "ppo", [])
    assert not any(o.startswith("ds4.max_token_len_per_gpu") for o in out)  # negative control: 8192 x 2 holds it


def test_explicit_settings_are_kept():
    cfg = _rl(n=32768, prompt=2048)
    out = seq_len.derived_overrides(cfg, "ppo", ["data.max_prompt_length=2048", "++ds4.max_token_len_per_gpu=20000"])
    assert "data.max_response_length=30720" in out and not any(o.startswith("data.max_prompt_length") for o in out)
    assert not any(o.startswith("ds4.max_token_len_per_gpu") for o in out)
    both = seq_len.derived_overrides(cfg, "ppo", ["data.max_prompt_length=2048", "data.max_response_length=4096",
                                                   "actor_rollout_ref.rollout.max_model_len=8000"])
    assert not any(o.startswith(("data.", "actor_rollout_ref.")) for o in both)


# ------------------------------------------------------------------ refusals (pure)

def test_explicit_lengths_that_do_not_fit_are_refused():
    problems = seq_len.check_lengths(_rl(n=4096, prompt=2048, response=4096), "ppo", None, "test")
    assert len(problems) == 1 and "2048 + 4096 = 6144, longer than ds4.max_seq_len=4096" in str(problems[0])
    assert "Fix:" in str(problems[0])
    problems = seq_len.check_lengths(_rl(model_len=2048), "ppo", None, "test")
    assert [p.setting for p in problems] == ["actor_rollout_ref.rollout.max_model_len"]
    assert "vLLM would refuse" in problems[0].message
    sft = {"ds4": {"max_seq_len": 4096}, "data": {"max_length": 8192}}
    assert [p.setting for p in seq_len.check_lengths(sft, "sft", None, "test")] == ["data.max_length"]
    # negative controls: lengths within N, max_model_len that holds them, SFT at N
    assert seq_len.check_lengths(_rl(n=4096, prompt=1024, response=3072, model_len=4096), "ppo", None, "test") == []
    assert seq_len.check_lengths({"ds4": {"max_seq_len": 8192}, "data": {"max_length": 8192}}, "sft", None, "test") == []
    assert [p.setting for p in seq_len.check_lengths(_rl(n=0), "ppo", None, "t")] == ["ds4.max_seq_len"]


def test_above_max_position_embeddings_is_refused():
    problems = seq_len.check_lengths(_rl(n=2_000_000, prompt=8192, response=1_991_808), "ppo", 1048576, "configs/ds4_model")
    assert len(problems) == 1 and problems[0].setting == "ds4.max_seq_len"
    assert "max_position_embeddings = 1048576 (configs/ds4_model)" in problems[0].message
    assert "ds4.max_seq_len <= 1048576" in problems[0].fix
    assert seq_len.check_lengths(_rl(n=1048576, prompt=8192, response=1040384), "ppo", 1048576, "t") == []  # control


def test_model_facts_carry_max_position_embeddings():
    for name in ("flash", "pro"):
        block = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "ds4_model" / f"{name}.yaml"))
        facts = DS4ModelFacts.from_recipe_block(block, "recipe")
        assert facts.max_position_embeddings == 1048576
        assert DS4ModelFacts.from_hf_config({"model_type": "deepseek_v4", "max_position_embeddings": 4096}, "cfg.json",
                                            facts).max_position_embeddings == 4096  # config.json wins
        assert DS4ModelFacts.from_hf_config({"model_type": "deepseek_v4"}, "cfg.json", facts).max_position_embeddings == 1048576
    from verl_ds4.models.ds41.provider import load_ds41_model_facts

    block = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "ds4_model" / "v41_flash.yaml"))
    assert load_ds41_model_facts(None, block, "recipe").max_position_embeddings == 1048576
    block.pop("max_position_embeddings")  # negative control: a block without it gives no limit
    assert load_ds41_model_facts(None, block, "recipe").max_position_embeddings is None


# ------------------------------------------------------------------ composed recipes

def test_grpo_32k_on_cp8_is_derived_and_accepted():
    cfg = compose_recipe("grpo", [CP8, "ds4.max_seq_len=32768"])
    assert cfg.data.max_prompt_length == 8192 and cfg.data.max_response_length == 24576
    assert cfg.actor_rollout_ref.rollout.max_model_len == 32768
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu * 8 >= 32768
    report = validate_recipe(cfg, "ppo", dry_run=True, raise_on_error=False)
    assert report.max_seq_len == 32768 and not report.errors, [str(e) for e in report.errors]
    # negative control: without the knob, today's lengths and verl's max_model_len (null)
    base = compose_recipe("grpo", [CP8])
    assert (base.data.max_prompt_length, base.data.max_response_length) == (1024, 2048)
    assert base.actor_rollout_ref.rollout.max_model_len is None
    assert derived_length_overrides("grpo", [CP8]) == []


def test_sft_and_v41_follow_the_knob():
    cfg = compose_recipe("sft", [CP8, "ds4.max_seq_len=16384"])
    assert cfg.data.max_length == 16384 and cfg.data.max_token_len_per_gpu == 4096
    assert compose_recipe("deepseek_v41_grpo", ["ds4.max_seq_len=8192"]).actor_rollout_ref.rollout.max_model_len == 8192
    kept = compose_recipe("sft", [CP8, "ds4.max_seq_len=16384", "data.max_length=8192"])
    assert kept.data.max_length == 8192  # a user's explicit setting is never replaced


def test_65536_on_the_default_mesh_at_its_cp_is_refused_with_levers():
    cfg = compose_recipe("grpo", ["ds4.max_seq_len=65536", "ds4.mesh.cp=2"])  # the CP is the user's: not derived
    report = validate_recipe(cfg, "ppo", dry_run=True, raise_on_error=False)
    memory = [str(e) for e in report.errors if e.setting == "actor memory"]
    assert memory and "ds4.mesh.cp=8" in memory[0] and "lower ds4.max_seq_len (now 65536" in memory[0]


# ------------------------------------------------------------------ launchers

@pytest.mark.parametrize("kind", ["sft", "ppo"])
def test_launchers_pass_max_seq_len(kind):
    text = (REPO / "scripts" / f"run_deepseek_v4_flash_{kind}_megatron.sh").read_text()
    assert "MAX_SEQ_LEN=${MAX_SEQ_LEN:-}" in text  # user-adjustable, empty = recipe default
    assert 'if [ -n "$MAX_SEQ_LEN" ]; then DATA+=("ds4.max_seq_len=$MAX_SEQ_LEN"); fi' in text
    assert re.search(r'ALL=\(.*"\$\{DS4_DERIVED_OVERRIDES\[@\]\}"', text)  # the derived lengths reach the trainer


def _launcher(kind: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("NNODES", "GPUS_PER_NODE", "PP", "EP", "CP", "MESH", "MAX_SEQ_LEN")}
    script = REPO / "scripts" / f"run_deepseek_v4_flash_{kind}_megatron.sh"
    return subprocess.run(["bash", str(script), "--dry-run"], env={**clean, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=300)


def test_grpo_launcher_dry_run_with_max_seq_len():
    out = _launcher("grpo", MESH="h200_64gpu_pp4_ep16_cp8", MAX_SEQ_LEN="32768")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("lengths : ds4.max_seq_len=32768: data.max_prompt_length 8192 + data.max_response_length 24576, "
            "rollout max_model_len 32768") in out.stdout
    out = _launcher("grpo", MESH="h200_64gpu_pp4_ep16_cp8")  # negative control: empty keeps the recipe's lengths
    assert out.returncode == 0 and "ds4.max_seq_len=null (the recipe's lengths): data.max_prompt_length 1024" in out.stdout


def test_shell_env_prints_the_derived_overrides():
    base = [sys.executable, "-m", "verl_ds4.cli", "recipe", "sft", "--shell-env", "--", CP8, "ds4.check_paths=false"]
    out = subprocess.run(base + ["ds4.max_seq_len=16384"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DS4_DERIVED_OVERRIDES=(data.max_length=16384)" in out.stdout.splitlines()
    out = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert "DS4_DERIVED_OVERRIDES=()" in out.stdout.splitlines()
