#!/usr/bin/env bash
# DeepSeek-V4-Flash SFT on verl's Megatron engine through Megatron-Bridge
# (THD packed sequences, TP=1, contiguous context parallelism, DS4 chat encoding with an
# assistant-only loss mask). Recipe: recipes/recipe/deepseek_v4_sft.yaml on verl's sft_trainer_engine.
#
#   bash scripts/run_deepseek_v4_flash_sft_megatron.sh --dry-run          # compose + validate + plan, no GPU
#   bash scripts/run_deepseek_v4_flash_sft_megatron.sh --print-ckpt-dir   # CKPT_DIR as these knobs give it (runs nothing)
#   MESH=h200_64gpu_pp4_ep8_cp4 bash scripts/run_deepseek_v4_flash_sft_megatron.sh
#   NNODES=8 GPUS_PER_NODE=8 PP=4 EP=8 CP=4 bash scripts/run_deepseek_v4_flash_sft_megatron.sh optim.lr=5e-6
#
# Multi-node: run the same command on every node with NODE_RANK, MASTER_ADDR and MASTER_PORT set.
# DeepSeek-V4.1-Flash: MODEL_VERSION=v41 (recipe deepseek_v41_sft, ds4_model=v41_flash, its default mesh
# h200_384gpu_pp1_ep192_cp2, MTP off: V4.1's mtp.* stages are a DSpark drafter).
# DS4-Pro: append `ds4_model=pro ds4_mesh=gb300_256gpu_pp4_ep64` (and MODEL_PATH to the Pro checkpoint);
# `verl-ds4 plan --fit --model pro --gpu GB300 --gpus 256` lists the meshes that fit.
# Before torchrun starts, the full config is composed and validated (`verl-ds4 recipe sft`): a bad
# mesh, budget or missing path fails in seconds with the setting and the fix.
set -euo pipefail

DRY_RUN=0
PRINT_CKPT_DIR=0
PASSTHROUGH=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --print-ckpt-dir) PRINT_CKPT_DIR=1 ;;
        *) PASSTHROUGH+=("$arg") ;;
    esac
done

# ---------------- user-adjustable ----------------
# v4 (DeepSeek-V4) or v41 (DeepSeek-V4.1: its recipe, model file and the defaults below).
MODEL_VERSION=${MODEL_VERSION:-v4}
case "$MODEL_VERSION" in
    v4) RECIPE_NAME=deepseek_v4_sft DS4_MODEL=flash ;;
    v41)
        RECIPE_NAME=deepseek_v41_sft DS4_MODEL=v41_flash
        MODEL_PATH=${MODEL_PATH:-$HOME/models/DeepSeek-V4.1-Flash}
        MESH=${MESH:-h200_384gpu_pp1_ep192_cp2}
        MTP=${MTP:-false}
        PROJECT_NAME=${PROJECT_NAME:-deepseek-v41-sft}
        EXP_NAME=${EXP_NAME:-v41-flash-megatron}
        ;;
    *) echo "MODEL_VERSION=$MODEL_VERSION: expected v4 (DeepSeek-V4) or v41 (DeepSeek-V4.1)" >&2; exit 2 ;;
esac
MODEL_PATH=${MODEL_PATH:-$HOME/models/DeepSeek-V4-Flash}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/gsm8k_ds4_sft/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/gsm8k_ds4_sft/test.parquet}
# Named mesh from configs/ds4_mesh/ (nodes, GPUs per node, PP/EP/CP). The knobs below, when set,
# replace single fields of it; empty means "take it from MESH".
MESH=${MESH:-h200_64gpu_pp8_ep8_cp2}
NNODES=${NNODES:-}
GPUS_PER_NODE=${GPUS_PER_NODE:-}
PP=${PP:-}
EP=${EP:-}
CP=${CP:-}
# The longest sequence in tokens (ds4.max_seq_len); empty: the recipe's (data.max_length 4096). Set, it derives
# data.max_length and, when the mesh's budget x CP is shorter, the token budget (docs/gpu-clusters.md, "Long sequences").
MAX_SEQ_LEN=${MAX_SEQ_LEN:-}
# data.max_length; empty: the recipe's, or MAX_SEQ_LEN when set (a value here is kept and checked against it).
MAX_LENGTH=${MAX_LENGTH:-}
# Token budget per GPU (ds4.max_token_len_per_gpu); empty: the mesh's, sized so the peak fits (docs/memory.md).
TOKENS_PER_GPU=${TOKENS_PER_GPU:-}
MTP=${MTP:-true}
OFFLOAD=${OFFLOAD:-false}
PROJECT_NAME=${PROJECT_NAME:-deepseek-v4-sft}
EXP_NAME=${EXP_NAME:-flash-megatron}
CKPT_DIR=${CKPT_DIR:-$HOME/checkpoints/$PROJECT_NAME/$EXP_NAME}
# Resume: auto (latest checkpoint in CKPT_DIR), disable, or a RESUME_FROM checkpoint folder.
RESUME_MODE=${RESUME_MODE:-auto}
RESUME_FROM=${RESUME_FROM:-}
# Restarts after the run dies (a rank or node lost, a non-zero exit of the trainer), each from the newest intact
# checkpoint in CKPT_DIR with resume_mode=auto; 0: stop at the first failure (docs/checkpoints.md, "Automatic restart").
MAX_RESTARTS=${MAX_RESTARTS:-3}
PYTHON=${PYTHON:-python3}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
# --------------------------------------------------
if [ "$PRINT_CKPT_DIR" = 1 ]; then
    echo "$CKPT_DIR"   # for scripts/slurm_sft.sbatch: the folder its supervisor checks and restarts from
    exit 0
fi

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
    "model.path=$MODEL_PATH"
    "ds4.mtp=$MTP"
    "ds4.offload.param=$OFFLOAD"
    "ds4.offload.optimizer=$OFFLOAD"
)

DATA=(
    "data.train_files=$TRAIN_FILES"
    "data.val_files=$VAL_FILES"
)
if [ -n "$MAX_SEQ_LEN" ]; then DATA+=("ds4.max_seq_len=$MAX_SEQ_LEN"); fi
if [ -n "$MAX_LENGTH" ]; then DATA+=("data.max_length=$MAX_LENGTH"); fi

if [ -n "$TOKENS_PER_GPU" ]; then DATA+=("ds4.max_token_len_per_gpu=$TOKENS_PER_GPU"); fi

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

ALL=("${RECIPE[@]}" "${MESH_OVERRIDES[@]}" "${MODEL[@]}" "${DATA[@]}" "${TRAINER[@]}" "${PASSTHROUGH[@]}")

if [ "$DRY_RUN" = 1 ]; then
    exec "$PYTHON" -m verl_ds4.cli recipe sft --dry-run -- "${ALL[@]}"
fi

# Validate (seconds, no GPU) and read back the resolved NNODES / GPUS_PER_NODE for torchrun and the
# overrides MAX_SEQ_LEN derives (DS4_DERIVED_OVERRIDES: lengths and budgets; empty without it).
DS4_DERIVED_OVERRIDES=()
LAUNCH_ENV=$("$PYTHON" -m verl_ds4.cli recipe sft --shell-env -- "${ALL[@]}")
eval "$LAUNCH_ENV"
ALL=("${RECIPE[@]}" "${MESH_OVERRIDES[@]}" "${MODEL[@]}" "${DATA[@]}" "${TRAINER[@]}" "${DS4_DERIVED_OVERRIDES[@]}" "${PASSTHROUGH[@]}")
# Multi-node: the checkpoint folder must be one folder that every node sees (a node-local disk is refused here,
# on every node, with the reason; verl_ds4.recipes.shared_folder, docs/checkpoints.md).
if [ "$NNODES" -gt 1 ]; then
    MASTER_ADDR="$MASTER_ADDR" MASTER_PORT="$MASTER_PORT" "$PYTHON" -W ignore -m verl_ds4.recipes.shared_folder \
        --dir "$CKPT_DIR" --nodes "$NNODES" --node-rank "$NODE_RANK" || exit 2
fi

exec torchrun \
    --nnodes="$NNODES" \
    --nproc_per_node="$GPUS_PER_NODE" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --master_port="$MASTER_PORT" \
    -m verl.trainer.sft_trainer \
    "${ALL[@]}"
