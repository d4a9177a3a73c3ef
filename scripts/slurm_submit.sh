#!/usr/bin/env bash
# Submit a DS4 recipe to Slurm.
#
#   bash scripts/slurm_submit.sh [--dry-run] sft         [overrides...]   # torchrun on every node
#   bash scripts/slurm_submit.sh [--dry-run] {ppo|grpo}  [overrides...]   # Ray on Slurm
#
# sft  -> sbatch scripts/slurm_sft.sbatch: one task per node runs the SFT local launcher
#         (scripts/run_deepseek_v4_flash_sft_megatron.sh), whose torchrun finds its rendezvous in
#         the PET_* variables the batch script exports (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, ...).
# ppo, grpo -> sbatch scripts/slurm_ray_rl.sbatch: a Ray head on the first node, workers on the
#         others, then scripts/ray_cluster.sh submit of the recipe.
# Extra arguments (Hydra overrides) go to the local launcher; everything after a literal `--` is
# passed untouched. --dry-run prints the sbatch command and the commands the batch script would run
# inside the allocation (with placeholder host names), and runs nothing.
#
# Recipe knobs: the local launchers' env variables, passed to the job through the environment:
#   MODEL_PATH TRAIN_FILES VAL_FILES NNODES GPUS_PER_NODE PP EP CP ROLLOUT_ENGINE ROLLOUT_TP
#   CKPT_DIR PROJECT_NAME EXP_NAME
# NNODES (default 1) and GPUS_PER_NODE (default 8) also size the allocation.
#
# Slurm knobs (user-adjustable):
#   CONTAINER_IMAGE   run every step in this image with pyxis/enroot (e.g. the docker/ image);
#                     unset: run on the nodes' own environment
#   CONTAINER_MOUNTS  pyxis --container-mounts (e.g. /data:/data,/ckpt:/ckpt)
#   CONTAINER_WORKDIR checkout inside the container (default /opt/verl-ds4, the image's copy)
#   JOB_NAME          Slurm job name (default ds4-<recipe>)
#   sbatch's own input variables apply as usual: SBATCH_PARTITION, SBATCH_ACCOUNT,
#   SBATCH_TIMELIMIT, SBATCH_QOS, ...
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
# shellcheck source=scripts/cluster_lib.sh
source "$REPO_ROOT/scripts/cluster_lib.sh"

usage() {
    ds4_print_header "${BASH_SOURCE[0]}"
}

ds4_parse_common_args "$@"
set -- "${DS4_ARGS[@]+"${DS4_ARGS[@]}"}"
if [ "$DS4_HELP" = 1 ] || [ $# -eq 0 ]; then
    usage
    [ "$DS4_HELP" = 1 ] && exit 0
    exit 2
fi

############################ user-adjustable ############################
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
#########################################################################

ds4_require_positive_int NNODES
ds4_require_positive_int GPUS_PER_NODE
export NNODES GPUS_PER_NODE

recipe=$1
shift
case "$recipe" in
    sft) batch_script=scripts/slurm_sft.sbatch batch_args=() ;;
    ppo | grpo) batch_script=scripts/slurm_ray_rl.sbatch batch_args=("$recipe") ;;
    *) ds4_die "unknown recipe '$recipe': expected sft, ppo or grpo" ;;
esac
# The batch script's own arguments, then `--` and the pass-through arguments for the recipe.
batch_args+=(-- "$@")
ds4_require_recipe_script "$REPO_ROOT" "$(ds4_recipe_script "$recipe")"

sbatch_args=(
    --job-name="${JOB_NAME:-ds4-$recipe}"
    --nodes="$NNODES"
    --ntasks-per-node=1
    --gpus-per-node="$GPUS_PER_NODE"
    --exclusive
    --chdir="$REPO_ROOT"
    --export=ALL
)

ds4_run sbatch "${sbatch_args[@]}" "$batch_script" "${batch_args[@]}"

if [ "$DRY_RUN" = 1 ]; then
    echo "# inside the allocation, $batch_script would run (host names are placeholders):"
    if [ -n "${CONTAINER_IMAGE:-}" ]; then
        echo "# (in the container the checkout is ${CONTAINER_WORKDIR:-/opt/verl-ds4}: paths of this checkout below become that)"
    fi
    DS4_PRINT_PREFIX="    " bash "$batch_script" --dry-run "${batch_args[@]}"
fi
