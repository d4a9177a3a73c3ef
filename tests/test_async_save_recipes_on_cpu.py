"""Async saves as the recipes and the CPU job offer them (issue 44, item 2); what the saves do is in
tests/test_ckpt_async_on_cpu.py (the order of the finalisation) and tests/test_cpu_sft_on_cpu.py (a real run killed
with a save in flight, resumed bit for bit).

* the SFT recipes: ``ds4.async_save`` (default false) sets verl's ``checkpoint.async_save``, and the plan says so;
* the RL recipes refuse an actor's or a critic's ``checkpoint.async_save=true`` at validation (verl 0.9.1's RL
  trainers never finalise async saves); control: false passes;
* the CPU job's ``ASYNC_SAVE`` knob: 0 or 1, anything else refused before anything starts.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from verl_ds4.recipes.compose import compose_recipe
from verl_ds4.recipes.plan import format_plan
from verl_ds4.recipes.validate import RecipeValidationError, validate_recipe

REPO = Path(__file__).resolve().parents[1]


def test_the_sft_recipe_offers_async_saves_off_by_default_and_the_plan_says_when_on():
    cfg = compose_recipe("sft")
    assert cfg.ds4.async_save is False and cfg.checkpoint.async_save is False
    plan = format_plan(cfg, validate_recipe(cfg, "sft", dry_run=True))
    assert "async saves" not in plan
    cfg = compose_recipe("sft", ["ds4.async_save=true"])
    assert cfg.checkpoint.async_save is True
    plan = format_plan(cfg, validate_recipe(cfg, "sft", dry_run=True))
    assert "save_freq=200, async saves)" in plan, plan


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.checkpoint.async_save", "critic.checkpoint.async_save"])
def test_an_rl_role_with_async_saves_is_refused_naming_the_key(key):
    recipe = "ppo" if key.startswith("critic") else "grpo"
    with pytest.raises(RecipeValidationError) as err:
        validate_recipe(compose_recipe(recipe, [f"{key}=true"]), "ppo", dry_run=True)
    assert f"{key}: is True, but verl 0.9.1's PPO trainer and its Ray workers never finalise" in str(err.value)
    assert "ds4.async_save=true in the SFT recipes" in str(err.value)
    report = validate_recipe(compose_recipe(recipe, [f"{key}=false"]), "ppo", dry_run=True)  # control
    assert not [p for p in report.errors if "async_save" in p.setting]


def test_the_cpu_job_takes_async_save_0_or_1_only():
    env = dict(os.environ, ASYNC_SAVE="yes", WORK_DIR="/nonexistent/never")
    done = subprocess.run(["bash", "scripts/run_ds4_proxy_sft_cpu.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "ASYNC_SAVE=yes: expected 0 (synchronous saves) or 1 (Megatron's async saves)" in done.stderr
