#!/usr/bin/env bash
# DeepSeek-V4-Flash GRPO (no critic; KL loss against the reference model) on verl's Megatron engine through
# Megatron-Bridge (THD, TP=1, contiguous context parallelism), rollout with vLLM or SGLang.
# Recipe: recipes/recipe/deepseek_v4_grpo.yaml on verl's ppo_trainer (model_engine=megatron).
#
#   bash scripts/run_deepseek_v4_flash_grpo_megatron.sh --dry-run          # compose + validate + plan, no GPU
#   NNODES=8 GPUS_PER_NODE=8 PP=4 EP=8 CP=4 bash scripts/run_deepseek_v4_flash_grpo_megatron.sh
#
# Start the Ray cluster first (ray start --head / --address on every node); this runs the driver.
# DS4-Pro: append `ds4_model=pro ds4_mesh=gb300_256gpu_pp4_ep64` (and MODEL_PATH to the Pro checkpoint);
# `verl-ds4 plan --fit --model pro --gpu GB300 --gpus 256` lists the meshes that fit.
# Before Ray starts, the full config is composed and validated (`verl-ds4 recipe grpo`): a bad
# mesh, budget, rollout TP or missing path fails in seconds with the setting and the fix.
#
# The launcher is the PPO one with the GRPO recipe: every knob (MODEL_PATH, MESH, CP, ROLLOUT_*, ...)
# is read there.
# delegates-to: run_deepseek_v4_flash_ppo_megatron.sh
set -euo pipefail

DS4_RL_RECIPE=grpo exec bash "$(dirname "${BASH_SOURCE[0]}")/run_deepseek_v4_flash_ppo_megatron.sh" "$@"
