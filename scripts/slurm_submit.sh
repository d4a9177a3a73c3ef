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
# NNODES (default 1) and GPUS_PER_NODE (default 8) also size the allocation. A GPU job needs MODEL_PATH
# and TRAIN_FILES (refused before sbatch without them).
#
# DS4_DEVICE=cpu (rehearsal, e.g. on scripts/local_slurm.sh): the same batch scripts run the CPU jobs
# (scripts/run_ds4_proxy_sft_cpu.sh, scripts/run_ds4_proxy_ppo_cpu.sh, the tiny DS4) with
# NPROC_PER_NODE CPU processes per node (default 2 on one node, 1 per node on more) and no GPU request.
#
# Slurm knobs (user-adjustable):
#   CONTAINER_IMAGE   run every step in this image with pyxis/enroot (e.g. the docker/ image);
#                     unset: run on the nodes' own environment
#   CONTAINER_MOUNTS  pyxis --container-mounts (e.g. /data:/data,/ckpt:/ckpt)
#   CONTAINER_WORKDIR checkout inside the container (default /opt/verl-ds4, the image's copy)
#   JOB_NAME          Slurm job name (default ds4-<recipe>)
#   MAX_RESTARTS      restarts after the run dies, each from the newest intact checkpoint (default 3; 0: none)
#   REQUEUE_BEFORE_S  sft: Slurm signals the job this many seconds before its time limit (--signal=B:USR1@N); it
#                     stops the run and requeues the job, which resumes from the newest intact checkpoint (default 300)
#   CLUSTER_LOG_DIR   where the job's output goes (default runs/slurm): <job name>-<job id>.out (the
#                     plan and the outcome; a requeued job's runs one after the other) and
#                     <job name>-<job id>/node<N>.log (each node's task)
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
MAX_RESTARTS=${MAX_RESTARTS:-3}         # restarts after the run dies, from the newest intact checkpoint (0: none)
REQUEUE_BEFORE_S=${REQUEUE_BEFORE_S:-300}  # sft: seconds before the time limit Slurm sends USR1: stop, requeue
#########################################################################

ds4_require_device
ds4_require_positive_int NNODES
ds4_require_positive_int GPUS_PER_NODE
ds4_require_positive_int REQUEUE_BEFORE_S
ds4_require_restarts
ds4_procs_per_node
export NNODES GPUS_PER_NODE DS4_DEVICE MAX_RESTARTS
[ "$DS4_DEVICE" = cpu ] && export NPROC_PER_NODE
CLUSTER_LOG_DIR=${CLUSTER_LOG_DIR:-runs/slurm}

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
if [ "$DRY_RUN" != 1 ]; then
    ds4_require_job_knobs
fi

job_name=${JOB_NAME:-ds4-$recipe}
sbatch_args=(
    --job-name="$job_name"
    --nodes="$NNODES"
    --ntasks-per-node=1
)
# On CPUs no GPU is requested (0 overrides the batch scripts' own #SBATCH --gpus-per-node=8).
if [ "$DS4_DEVICE" = gpu ]; then
    sbatch_args+=(--gpus-per-node="$GPUS_PER_NODE")
else
    sbatch_args+=(--gpus-per-node=0)
fi
# --requeue: a job Slurm requeues (preemption, node failure, `scontrol requeue`) runs the batch script
# again, and the launchers resume from the last checkpoint in CKPT_DIR / WORK_DIR. --open-mode=append: the
# requeued run adds to the job's output file instead of truncating it (what each run printed, and why it ended).
sbatch_args+=(
    --requeue
    --open-mode=append
    --exclusive
    --chdir="$REPO_ROOT"
    --output="$CLUSTER_LOG_DIR/%x-%j.out"
    --export=ALL
)
# sft: Slurm sends the batch shell USR1 REQUEUE_BEFORE_S seconds before the time limit; the batch script stops the
# run and requeues the job, which resumes from the newest intact checkpoint (one of the MAX_RESTARTS).
[ "$recipe" = sft ] && sbatch_args+=(--signal=B:USR1@"$REQUEUE_BEFORE_S")
export CLUSTER_LOG_DIR

ds4_say "submit      $recipe ($DS4_DEVICE): $(ds4_recipe_script "$recipe") on $NNODES node(s) x $NPROC_PER_NODE process(es) per node"
ds4_say "nodes       $NNODES, chosen by Slurm; the job prints their list and the rendezvous address first"
if [ "$recipe" = sft ]; then
    ds4_say "restarts    MAX_RESTARTS=$MAX_RESTARTS: the job restarts a run that dies from the newest intact checkpoint; USR1 ${REQUEUE_BEFORE_S}s before the time limit requeues it"
else
    ds4_say "restarts    MAX_RESTARTS=$MAX_RESTARTS: the launcher in the Ray job restarts a driver that dies, from the newest intact checkpoint; a lost node requeues the job (--requeue)"
fi
if [ "$recipe" = sft ]; then
    ds4_say "rendezvous  torchrun: the first node's address, port ${MASTER_PORT:-29500} (MASTER_PORT)"
else
    ds4_say "rendezvous  Ray head on the first node, GCS port ${RAY_PORT:-6379}, job API port ${RAY_DASHBOARD_PORT:-8265}"
fi
if [ "$recipe" = sft ]; then
    ds4_say "logs        $CLUSTER_LOG_DIR/$job_name-<job id>.out and $CLUSTER_LOG_DIR/$job_name-<job id>/node<N>.log"
else
    ds4_say "logs        $CLUSTER_LOG_DIR/$job_name-<job id>.out (the trainer) and $CLUSTER_LOG_DIR/$job_name-<job id>/ray-{head,worker-<N>}.log"
fi
[ "$DRY_RUN" = 1 ] || mkdir -p "$CLUSTER_LOG_DIR"
ds4_run sbatch "${sbatch_args[@]}" "$batch_script" "${batch_args[@]}"

if [ "$DRY_RUN" = 1 ]; then
    echo "# inside the allocation, $batch_script would run (host names are placeholders):"
    if [ -n "${CONTAINER_IMAGE:-}" ]; then
        echo "# (in the container the checkout is ${CONTAINER_WORKDIR:-/opt/verl-ds4}: paths of this checkout below become that)"
    fi
    DS4_PRINT_PREFIX="    " bash "$batch_script" --dry-run "${batch_args[@]}"
fi
