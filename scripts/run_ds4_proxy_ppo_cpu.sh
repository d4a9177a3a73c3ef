#!/usr/bin/env bash
# Tiny DeepSeek-V4 PPO with a GAE critic on CPU, through verl's own main_ppo (v1 trainer, Ray).
#
#   prompts -> cpu_demo rollout (current actor weights) -> rule reward -> critic values (Megatron value head)
#   -> GAE -> actor update (PPO + KL to the reference model) and critic update -> weight sync -> checkpoint
# Every step the mismatch gate compares the rollout's log-probs with the actor's recompute at CP (verl_ds4/rollout/mismatch_gate.py).
#
# Actor, reference and critic are the full tiny DS4 (MODEL=ds4: mHC, DS4 attention, DS4 MoE with a hash layer,
# started from the assets' DS4 checkpoint folder) or, with MODEL=ds4_proxy, the attention-only DS4 proxy, on
# verl-ds4's CPU Megatron engine, THD, context parallel size 2, contiguous layout.
# The recipe is recipes/recipe/ds4_proxy_ppo_cpu.yaml; every CPU-only setting is in configs/cpu/laptop.yaml.
# A test/demo: no GPU, about 2 cores and a few GB of memory; the model is random, so do not expect learning.
#
# Usage:  bash scripts/run_ds4_proxy_ppo_cpu.sh [--verbose] [extra Hydra overrides...]
#
# The console is quiet (verl_ds4.cpu.console): start-up facts, one line per PPO step with an
# ETA, and a summary table. The full output of verl, Ray and the workers goes to
# $WORK_DIR/logs/<timestamp>.log (also logs/latest.log); VERBOSE=1 or --verbose shows it on the
# console too. On a failure the last 40 lines of that log are printed and the script exits non-zero.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---------------------------------- user-adjustable ----------------------------------
PYTHON=${PYTHON:-python}
MODEL=${MODEL:-ds4}                     # ds4 (full tiny DS4 checkpoint folder) | ds4_proxy (attention-only proxy)
WORK_DIR=${WORK_DIR:-runs/${MODEL}_ppo_cpu}
STEPS=${STEPS:-3}                       # PPO steps (each: rollout, reward, values, GAE, updates, weight sync)
BATCH=${BATCH:-8}                       # prompts per step
RESPONSE_LENGTH=${RESPONSE_LENGTH:-16}  # tokens sampled per prompt (at most)
CP=${CP:-2}                             # context-parallel size of actor, reference and critic
N_TRAIN=${N_TRAIN:-256}                 # prompts written to the training parquet
SAVE_FREQ=${SAVE_FREQ:-$STEPS}          # checkpoint every N steps
RESUME_MODE=${RESUME_MODE:-disable}     # disable | auto (continue from the latest checkpoint of this same run)
MISMATCH_MAX=${MISMATCH_MAX:-1e-5}     # stop when rollout and actor log-probs differ by more (max abs; null: report only)
VERBOSE=${VERBOSE:-0}                   # 1: verl's, Ray's and the workers' full output on the console
# --------------------------------------------------------------------------------------

OVERRIDES=()
for arg in "$@"; do
    case "$arg" in
        --verbose) VERBOSE=1 ;;
        *) OVERRIDES+=("$arg") ;;
    esac
done

ASSETS="$WORK_DIR/assets"
if [ "$VERBOSE" = 1 ]; then
    "$PYTHON" -m verl_ds4.rollout.demo_task --out "$ASSETS" --n-train "$N_TRAIN" --model "$MODEL" >/dev/null
elif ! assets_out=$("$PYTHON" -m verl_ds4.rollout.demo_task --out "$ASSETS" --n-train "$N_TRAIN" --model "$MODEL" 2>&1); then
    printf '%s\n' "$assets_out" >&2   # quiet unless it fails
    echo "[verl-ds4] FAILED: writing the assets to $ASSETS" >&2
    exit 1
fi
REWARD_FILE=$("$PYTHON" -c 'import verl_ds4.rollout.demo_task as m; print(m.__file__)')

# Read by the driver at `import verl`; configs/cpu/laptop.yaml passes them on to the Ray workers.
export VERL_PLATFORM=cpu
export VERL_USE_EXTERNAL_MODULES=verl_ds4.cpu.platform,verl_ds4.cpu.engine,verl_ds4.rollout,verl_ds4.rollout.cpu_weight_export,verl_ds4.cpu.ds4_builder,verl_ds4.rollout.mismatch_gate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false

RECIPE=(
    'hydra.searchpath=[pkg://verl_ds4.recipes_data,pkg://verl_ds4.configs_data]'
    +recipe=ds4_proxy_ppo_cpu
)
DATA=(
    data.train_files="$ASSETS/data/train.parquet"
    data.val_files="$ASSETS/data/val.parquet"
    data.train_batch_size="$BATCH"
    data.max_response_length="$RESPONSE_LENGTH"
    reward.custom_reward_function.path="$REWARD_FILE"
)
MODEL_ARGS=(
    actor_rollout_ref.model.path="$ASSETS/model"
    actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH"
    actor_rollout_ref.actor.megatron.context_parallel_size="$CP"
    actor_rollout_ref.ref.megatron.context_parallel_size="$CP"
    critic.megatron.context_parallel_size="$CP"
)
TRAINER=(
    trainer.total_training_steps="$STEPS"
    trainer.save_freq="$SAVE_FREQ"
    trainer.resume_mode="$RESUME_MODE"
    trainer.default_local_dir="$WORK_DIR/checkpoints"
    trainer.v1.ds4_gated_sync.max_log_prob_diff="$MISMATCH_MAX"
)

# Resuming: refuse at start-up, before Ray starts, a checkpoint another run wrote (a changed CP size,
# model config or task; verl_ds4/recipes/resume_check.py). The trainer checks again (the recipe's
# trainer.checkpoint_callback_class), also when the resume is asked for by an override instead.
if [ "$RESUME_MODE" != disable ]; then
    if ! check_out=$("$PYTHON" -W ignore -m verl_ds4.recipes.resume_check ppo -- "${RECIPE[@]}" "${DATA[@]}" "${MODEL_ARGS[@]}" \
            "${TRAINER[@]}" ${OVERRIDES[@]+"${OVERRIDES[@]}"} 2>&1); then
        printf '%s\n' "$check_out" >&2
        echo "[verl-ds4] FAILED: RESUME_MODE=$RESUME_MODE would resume a checkpoint in $WORK_DIR/checkpoints that another run wrote" >&2
        exit 2
    fi
    RESUME_FACT="; ${check_out##*$'\n'}"
fi

CONSOLE=(
    --work-dir "$WORK_DIR" --steps "$STEPS"
    --fact "job=PPO with a GAE critic, verl.trainer.main_ppo on CPU (Ray, recipe ds4_proxy_ppo_cpu)"
    --fact "model=$MODEL ($ASSETS/model; ds4: the tiny DS4 checkpoint, ds4_proxy: attention-only proxy): actor, reference, critic"
    --fact "parallel=CP $CP (actor, reference, critic), TP 1, PP 1"
    --fact "data=$ASSETS/data/train.parquet ($N_TRAIN prompts), batch $BATCH, response <= $RESPONSE_LENGTH tokens, $STEPS steps"
    --fact "gate=rollout vs actor log-probs (CP $CP) every step: stop above max abs $MISMATCH_MAX (MISMATCH_MAX)"
    --fact "checkpoints=$WORK_DIR/checkpoints (every $SAVE_FREQ steps, resume_mode=$RESUME_MODE${RESUME_FACT:-})"
)
[ "$VERBOSE" = 1 ] && CONSOLE+=(--verbose)

"$PYTHON" -m verl_ds4.cpu.console ppo "${CONSOLE[@]}" -- \
    "$PYTHON" -m verl.trainer.main_ppo "${RECIPE[@]}" "${DATA[@]}" "${MODEL_ARGS[@]}" "${TRAINER[@]}" \
    ${OVERRIDES[@]+"${OVERRIDES[@]}"}
