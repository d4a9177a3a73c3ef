#!/usr/bin/env bash
# DeepSeek-V4-Flash PPO with a GAE critic (DS4 value head) on verl's Megatron engine through
# Megatron-Bridge (THD, TP=1, contiguous context parallelism), rollout with vLLM or SGLang.
# Recipe: recipes/recipe/deepseek_v4_ppo.yaml on verl's ppo_trainer (model_engine=megatron).
#
#   bash scripts/run_deepseek_v4_flash_ppo_megatron.sh --dry-run          # compose + validate + plan, no GPU
#   NNODES=8 GPUS_PER_NODE=8 PP=4 EP=8 CP=4 bash scripts/run_deepseek_v4_flash_ppo_megatron.sh
#
# Start the Ray cluster first (ray start --head / --address on every node); this runs the driver.
# DeepSeek-V4.1-Flash (GRPO only): MODEL_VERSION=v41 (recipe deepseek_v41_grpo, ds4_model=v41_flash,
# its default mesh gb300_128gpu_pp1_ep128_cp2).
# DS4-Pro: GRPO only on the shipped meshes (scripts/run_deepseek_v4_flash_grpo_megatron.sh); PPO's critic doubles
# the states verl offloads to the host, more than a GB300 node's RAM on gb300_256gpu_pp4_ep64 (its not_for);
# `verl-ds4 plan --fit --model pro --gpu GB300 --gpus 256-512 --recipe ppo` lists the meshes that fit.
# Before Ray starts, the full config is composed and validated (`verl-ds4 recipe ppo`): a bad
# mesh, budget, rollout TP or missing path fails in seconds with the setting and the fix.
# scripts/run_deepseek_v4_flash_grpo_megatron.sh runs this launcher with DS4_RL_RECIPE=grpo.
set -euo pipefail

RL_RECIPE=${DS4_RL_RECIPE:-ppo}   # ppo | grpo (set by the GRPO launcher)
case "$RL_RECIPE" in
    ppo | grpo) ;;
    *) echo "DS4_RL_RECIPE=$RL_RECIPE: expected ppo or grpo" >&2; exit 2 ;;
esac

DRY_RUN=0
PASSTHROUGH=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        *) PASSTHROUGH+=("$arg") ;;
    esac
done

# ---------------- user-adjustable ----------------
# v4 (DeepSeek-V4) or v41 (DeepSeek-V4.1, GRPO only: its recipe, model file and the defaults below).
MODEL_VERSION=${MODEL_VERSION:-v4}
case "$MODEL_VERSION:$RL_RECIPE" in
    v4:*) RECIPE_NAME=deepseek_v4_$RL_RECIPE DS4_MODEL=flash ;;
    v41:grpo)
        RECIPE_NAME=deepseek_v41_grpo DS4_MODEL=v41_flash
        MODEL_PATH=${MODEL_PATH:-$HOME/models/DeepSeek-V4.1-Flash}
        MESH=${MESH:-gb300_128gpu_pp1_ep128_cp2}
        PROJECT_NAME=${PROJECT_NAME:-deepseek-v41-grpo}
        EXP_NAME=${EXP_NAME:-v41-flash-megatron}
        ;;
    v41:*) echo "MODEL_VERSION=v41: DeepSeek-V4.1 has a GRPO recipe only (deepseek_v41_grpo); use scripts/run_deepseek_v4_flash_grpo_megatron.sh" >&2; exit 2 ;;
    *) echo "MODEL_VERSION=$MODEL_VERSION: expected v4 (DeepSeek-V4) or v41 (DeepSeek-V4.1)" >&2; exit 2 ;;
esac
MODEL_PATH=${MODEL_PATH:-$HOME/models/DeepSeek-V4-Flash}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/gsm8k_ds4_rl/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/gsm8k_ds4_rl/test.parquet}
# Named mesh from configs/ds4_mesh/ (nodes, GPUs per node, PP/EP/CP). The knobs below, when set,
# replace single fields of it; empty means "take it from MESH".
MESH=${MESH:-h200_64gpu_pp8_ep8_cp2}
NNODES=${NNODES:-}
GPUS_PER_NODE=${GPUS_PER_NODE:-}
PP=${PP:-}
EP=${EP:-}
CP=${CP:-}
# Rollout: vllm or sglang; tensor parallel size per replica (empty: GPUs per node); FP8 weights
# (ROLLOUT_QUANT=fp8).
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-vllm}
ROLLOUT_TP=${ROLLOUT_TP:-}
ROLLOUT_QUANT=${ROLLOUT_QUANT:-}
# MoE router replay: disabled, R2 or R3 (R3 also turns on rollout routing replay).
ROUTER_REPLAY=${ROUTER_REPLAY:-disabled}
# Rollout indexer replay (true/false): the actor replays the rollout's sparse-attention top-k choices. Off until
# the rollout engine returns them (vLLM, SGLang do not yet: the validator refuses it with them).
INDEXER_REPLAY=${INDEXER_REPLAY:-false}
# The longest sequence, prompt + response, in tokens (ds4.max_seq_len); empty: the recipe's (1024 + 2048). Set, it
# derives the prompt (min(N/4, 8192)) and response (the rest) lengths, vLLM's max_model_len and, when the mesh's
# budget x CP is shorter, the token budgets (docs/gpu-clusters.md, "Long sequences").
MAX_SEQ_LEN=${MAX_SEQ_LEN:-}
# data.max_prompt_length / data.max_response_length; empty: the recipe's, or derived from MAX_SEQ_LEN (a value
# set here is kept and checked against it).
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
# Token budget per GPU (ds4.max_token_len_per_gpu); empty: the mesh's, sized so the peak fits (docs/memory.md).
TOKENS_PER_GPU=${TOKENS_PER_GPU:-}
OFFLOAD=${OFFLOAD:-true}
PROJECT_NAME=${PROJECT_NAME:-deepseek-v4-$RL_RECIPE}
EXP_NAME=${EXP_NAME:-flash-megatron}
CKPT_DIR=${CKPT_DIR:-$HOME/checkpoints/$PROJECT_NAME/$EXP_NAME}
# Resume: auto (latest checkpoint in CKPT_DIR), disable, or a RESUME_FROM checkpoint folder.
RESUME_MODE=${RESUME_MODE:-auto}
RESUME_FROM=${RESUME_FROM:-}
# Restarts after the run dies (a rank or node lost, a non-zero exit of the trainer), each from the newest intact
# checkpoint in CKPT_DIR with resume_mode=auto; 0: stop at the first failure (docs/checkpoints.md, "Automatic restart").
MAX_RESTARTS=${MAX_RESTARTS:-3}
# On a Ray cluster of NNODES > 1: seconds a start waits for NNODES alive nodes (a restart after a node was lost waits
# for its replacement; then the run stops with the count it saw).
RAY_WAIT_TIMEOUT=${RAY_WAIT_TIMEOUT:-600}
PYTHON=${PYTHON:-python3}
# --------------------------------------------------

# Automatic restart (verl_ds4.recipes.supervise): with MAX_RESTARTS > 0 the launcher runs itself again under the
# supervisor, which refuses a bad MAX_RESTARTS and a checkpoint folder that cannot take a checkpoint first, then
# restarts a run that dies from its newest intact checkpoint (RESUME_MODE=auto); with 0 only those checks run.
# DS4_SUPERVISED: already supervised (by it, or by the Slurm batch script around every node); DS4_CKPT_CHECKED:
# the supervisor checked the folder.
# --dry-run checks MAX_RESTARTS only (the folder is the cluster's).
RESTART_MODE=$RESUME_MODE
[ -n "$RESUME_FROM" ] && RESTART_MODE=resume_path
if [ "$DRY_RUN" = 1 ]; then
    "$PYTHON" -W ignore -m verl_ds4.recipes.supervise --check-only --max-restarts "$MAX_RESTARTS" || exit 2
    echo "[verl-ds4] restarts    MAX_RESTARTS=$MAX_RESTARTS: a run that dies starts again from its newest intact checkpoint in $CKPT_DIR (resume_mode=auto)"
elif [ -z "${DS4_SUPERVISED:-}" ] && [ "$MAX_RESTARTS" != 0 ]; then
    exec "$PYTHON" -W ignore -m verl_ds4.recipes.supervise --max-restarts "$MAX_RESTARTS" --resume-mode "$RESTART_MODE" \
        --ckpt-dir "$CKPT_DIR" -- bash "${BASH_SOURCE[0]}" "$@"
elif [ -z "${DS4_CKPT_CHECKED:-}" ] && ! "$PYTHON" -W ignore -m verl_ds4.recipes.supervise --check-only \
        --max-restarts "$MAX_RESTARTS" --ckpt-dir "$CKPT_DIR"; then
    exit 2
fi

RECIPE=(
    "hydra.searchpath=[pkg://verl_ds4.recipes_data,pkg://verl_ds4.configs_data]"
    "+recipe=$RECIPE_NAME"
    "ds4_model=$DS4_MODEL"
    "ds4_mesh=$MESH"
)

MESH_OVERRIDES=()
if [ -n "$NNODES" ]; then MESH_OVERRIDES+=("ds4.mesh.nnodes=$NNODES"); fi
if [ -n "$GPUS_PER_NODE" ]; then MESH_OVERRIDES+=("ds4.mesh.gpus_per_node=$GPUS_PER_NODE"); fi
if [ -n "$PP" ]; then MESH_OVERRIDES+=("ds4.mesh.pp=$PP"); fi
if [ -n "$EP" ]; then MESH_OVERRIDES+=("ds4.mesh.ep=$EP"); fi
if [ -n "$CP" ]; then MESH_OVERRIDES+=("ds4.mesh.cp=$CP"); fi

MODEL=(
    "actor_rollout_ref.model.path=$MODEL_PATH"
    "ds4.router_replay=$ROUTER_REPLAY"
    "ds4.indexer_replay=$INDEXER_REPLAY"
    "ds4.offload.param=$OFFLOAD"
    "ds4.offload.optimizer=$OFFLOAD"
)
if [ -n "$TOKENS_PER_GPU" ]; then MODEL+=("ds4.max_token_len_per_gpu=$TOKENS_PER_GPU"); fi
if [ "$ROUTER_REPLAY" = R3 ]; then MODEL+=(actor_rollout_ref.rollout.enable_rollout_routing_replay=true); fi

ROLLOUT=("ds4.rollout.engine=$ROLLOUT_ENGINE")
if [ -n "$ROLLOUT_TP" ]; then ROLLOUT+=("ds4.rollout.tp=$ROLLOUT_TP"); fi
if [ -n "$ROLLOUT_QUANT" ]; then ROLLOUT+=("ds4.rollout.quantization=$ROLLOUT_QUANT"); fi

DATA=(
    "data.train_files=$TRAIN_FILES"
    "data.val_files=$VAL_FILES"
    "data.train_batch_size=$TRAIN_BATCH_SIZE"
)
if [ -n "$MAX_SEQ_LEN" ]; then DATA+=("ds4.max_seq_len=$MAX_SEQ_LEN"); fi
if [ -n "$MAX_PROMPT_LENGTH" ]; then DATA+=("data.max_prompt_length=$MAX_PROMPT_LENGTH"); fi
if [ -n "$MAX_RESPONSE_LENGTH" ]; then DATA+=("data.max_response_length=$MAX_RESPONSE_LENGTH"); fi

TRAINER=(
    "trainer.project_name=$PROJECT_NAME"
    "trainer.experiment_name=$EXP_NAME"
    "trainer.default_local_dir=$CKPT_DIR"
)
if [ -n "$RESUME_FROM" ]; then
    TRAINER+=(trainer.resume_mode=resume_path "trainer.resume_from_path=$RESUME_FROM")
else
    TRAINER+=("trainer.resume_mode=$RESUME_MODE")
fi

ALL=("${RECIPE[@]}" "${MESH_OVERRIDES[@]}" "${MODEL[@]}" "${ROLLOUT[@]}" "${DATA[@]}" "${TRAINER[@]}" "${PASSTHROUGH[@]}")

if [ "$DRY_RUN" = 1 ]; then
    exec "$PYTHON" -m verl_ds4.cli recipe "$RL_RECIPE" --dry-run -- "${ALL[@]}"
fi

# Validate (seconds, no GPU) before Ray schedules any worker; read back the overrides MAX_SEQ_LEN derives
# (DS4_DERIVED_OVERRIDES: lengths, vLLM's max_model_len, budgets; empty without it) for the trainer.
DS4_DERIVED_OVERRIDES=()
LAUNCH_ENV=$("$PYTHON" -m verl_ds4.cli recipe "$RL_RECIPE" --shell-env -- "${ALL[@]}")
eval "$LAUNCH_ENV"
ALL=("${RECIPE[@]}" "${MESH_OVERRIDES[@]}" "${MODEL[@]}" "${ROLLOUT[@]}" "${DATA[@]}" "${TRAINER[@]}" "${DS4_DERIVED_OVERRIDES[@]}" "${PASSTHROUGH[@]}")
# On a Ray cluster of several nodes: the run needs NNODES alive nodes (a restart after a node was lost waits, up to
# RAY_WAIT_TIMEOUT, for its replacement), and the checkpoint folder must be one folder that every node sees (a
# node-local disk is refused here with the reason; one task on each node; verl_ds4.recipes.shared_folder,
# docs/checkpoints.md).
if [ -n "${RAY_ADDRESS:-}" ] && [ "$NNODES" -gt 1 ]; then
    [[ $RAY_WAIT_TIMEOUT =~ ^[1-9][0-9]*$ ]] || { echo "RAY_WAIT_TIMEOUT=$RAY_WAIT_TIMEOUT: expected a positive integer (seconds)" >&2; exit 2; }
    "$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/ray_wait_nodes.py" --nodes "$NNODES" --timeout "$RAY_WAIT_TIMEOUT" --quiet || exit 2
    "$PYTHON" -W ignore -m verl_ds4.recipes.shared_folder --ray --dir "$CKPT_DIR" --nodes "$NNODES" || exit 2
fi

exec "$PYTHON" -m verl.trainer.main_ppo "${ALL[@]}"
