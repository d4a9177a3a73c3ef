#!/usr/bin/env bash
# Ray cluster launcher for the DS4 RL recipes (PPO with a critic, GRPO).
#
#   bash scripts/ray_cluster.sh [--dry-run] start-head   [ray start args...]   # on the head node
#   bash scripts/ray_cluster.sh [--dry-run] start-worker [ray start args...]   # on every other node
#   bash scripts/ray_cluster.sh [--dry-run] wait-nodes                         # until $NNODES nodes are up
#   bash scripts/ray_cluster.sh [--dry-run] submit {ppo|grpo} [overrides...]   # from any node
#   bash scripts/ray_cluster.sh [--dry-run] stop                               # on every node
#
# `submit` runs `ray job submit` of the recipe's local launcher
# (scripts/run_deepseek_v4_flash_{ppo,grpo}_megatron.sh) with a runtime env that carries verl-ds4 to
# every worker: working_dir ships this checkout (launchers, recipes, configs, verl_ds4 sources) and
# env_vars carry the recipe knobs plus VERL_USE_EXTERNAL_MODULES=<our plugin modules>, so that verl
# imports the plugin in every process even where verl-ds4 is not pip-installed. Extra arguments
# (Hydra overrides) go to the local launcher; everything after a literal `--` is passed untouched.
# --dry-run (anywhere before `--`) prints the commands and runs nothing.
#
# Recipe knobs (passed through to the local launcher on the cluster; unset ones keep its defaults):
#   MODEL_PATH TRAIN_FILES VAL_FILES NNODES GPUS_PER_NODE PP EP CP ROLLOUT_ENGINE ROLLOUT_TP
#   CKPT_DIR PROJECT_NAME EXP_NAME
#   The local launcher's other knobs (every NAME=${NAME:-...} it reads, e.g. MESH, ROLLOUT_QUANT),
#   every VERL_* and NCCL_* variable, and the names listed in EXTRA_ENV_VARS are carried too.
#
# Cluster knobs (user-adjustable):
#   RAY_HEAD_IP        head node address (required by start-worker; default 127.0.0.1 otherwise)
#   RAY_PORT           GCS port of the head (default 6379)
#   RAY_DASHBOARD_PORT dashboard / job API port (default 8265)
#   RAY_ADDRESS        job API address for submit (default http://$RAY_HEAD_IP:$RAY_DASHBOARD_PORT)
#   GPUS_PER_NODE      GPUs each node offers to Ray (default 8)
#   RAY_NUM_CPUS       CPUs each node offers to Ray (default: Ray detects them)
#   RAY_WORKING_DIR    directory shipped as the job's working_dir (default: this checkout;
#                      set it empty to run the launcher from the image's copy instead)
#   RAY_JOB_ID         submission id (default: Ray generates one)
#   RAY_NO_WAIT        1: return after submitting instead of following the job's logs
#   RAY_WAIT_TIMEOUT   seconds wait-nodes waits for $NNODES nodes (default 600)
#   EXTRA_ENV_VARS     more env variable names to carry to the job, space separated
#
# Example (4 nodes x 8 GPUs, PPO):
#   RAY_HEAD_IP=10.0.0.1 bash scripts/ray_cluster.sh start-head           # node 0
#   RAY_HEAD_IP=10.0.0.1 bash scripts/ray_cluster.sh start-worker         # nodes 1..3
#   RAY_HEAD_IP=10.0.0.1 NNODES=4 MODEL_PATH=/ckpt/DeepSeek-V4-Flash \
#       bash scripts/ray_cluster.sh submit ppo trainer.total_epochs=1
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
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RAY_NUM_CPUS=${RAY_NUM_CPUS:-}
RAY_WORKING_DIR=${RAY_WORKING_DIR-$REPO_ROOT}
RAY_JOB_ID=${RAY_JOB_ID:-}
RAY_NO_WAIT=${RAY_NO_WAIT:-0}
RAY_WAIT_TIMEOUT=${RAY_WAIT_TIMEOUT:-600}
#########################################################################

ds4_require_positive_int GPUS_PER_NODE

ray_resource_args() {
    RESOURCE_ARGS=(--num-gpus="$GPUS_PER_NODE")
    if [ -n "$RAY_NUM_CPUS" ]; then
        ds4_require_positive_int RAY_NUM_CPUS
        RESOURCE_ARGS+=(--num-cpus="$RAY_NUM_CPUS")
    fi
}

command_name=$1
shift
case "$command_name" in
    start-head)
        ray_resource_args
        # Without RAY_HEAD_IP, Ray picks this node's address itself.
        [ -n "${RAY_HEAD_IP:-}" ] && RESOURCE_ARGS+=(--node-ip-address="$RAY_HEAD_IP")
        ds4_run ray start --head --port="$RAY_PORT" --dashboard-host=0.0.0.0 \
            --dashboard-port="$RAY_DASHBOARD_PORT" "${RESOURCE_ARGS[@]}" "$@"
        ;;
    start-worker)
        [ -n "${RAY_HEAD_IP:-}" ] || ds4_die "start-worker needs RAY_HEAD_IP, the head node's address (e.g. export RAY_HEAD_IP=10.0.0.1)"
        ray_resource_args
        ds4_run ray start --address="$RAY_HEAD_IP:$RAY_PORT" "${RESOURCE_ARGS[@]}" "$@"
        ;;
    wait-nodes)
        NNODES=${NNODES:-1}
        ds4_require_positive_int NNODES
        ds4_require_positive_int RAY_WAIT_TIMEOUT
        wait_args=(--nodes "$NNODES" --timeout "$RAY_WAIT_TIMEOUT")
        # An explicit GCS address also works from another container on the head node.
        [ -n "${RAY_HEAD_IP:-}" ] && wait_args+=(--address "$RAY_HEAD_IP:$RAY_PORT")
        ds4_run "$PYTHON" scripts/ray_wait_nodes.py "${wait_args[@]}"
        ;;
    submit)
        [ $# -ge 1 ] || ds4_die "submit needs a recipe: ppo or grpo (e.g. bash scripts/ray_cluster.sh submit ppo)"
        recipe=$1
        shift
        case "$recipe" in
            ppo | grpo) ;;
            sft) ds4_die "sft runs with torchrun, not Ray: use scripts/slurm_submit.sh sft or the local launcher on each node" ;;
            *) ds4_die "unknown RL recipe '$recipe': expected ppo or grpo" ;;
        esac
        script=$(ds4_recipe_script "$recipe")
        if [ -n "$RAY_WORKING_DIR" ]; then
            [ -d "$RAY_WORKING_DIR" ] || ds4_die "RAY_WORKING_DIR=$RAY_WORKING_DIR is not a directory"
            ds4_require_recipe_script "$RAY_WORKING_DIR" "$script"
        else
            # No working_dir: the job runs the launcher from this path on the head node (the image's
            # /opt/verl-ds4 when submitting from inside the image).
            ds4_require_recipe_script "$REPO_ROOT" "$script"
            script=$REPO_ROOT/$script
        fi
        address=${RAY_ADDRESS:-http://${RAY_HEAD_IP:-127.0.0.1}:$RAY_DASHBOARD_PORT}
        # The launcher that runs on the cluster: the shipped working_dir's, else this checkout's.
        launcher_path=${RAY_WORKING_DIR:-$REPO_ROOT}/$(ds4_recipe_script "$recipe")
        runtime_env=$(ds4_ray_runtime_env_json "$RAY_WORKING_DIR" "$(ds4_plugin_modules "$REPO_ROOT")" "$launcher_path")
        submit_args=(--address="$address" --runtime-env-json="$runtime_env")
        [ -n "$RAY_JOB_ID" ] && submit_args+=(--submission-id="$RAY_JOB_ID")
        [ "$RAY_NO_WAIT" = 1 ] && submit_args+=(--no-wait)
        ds4_run ray job submit "${submit_args[@]}" -- bash "$script" "$@"
        ;;
    stop)
        ds4_run ray stop "$@"
        ;;
    *)
        usage >&2
        ds4_die "unknown command '$command_name': expected start-head, start-worker, wait-nodes, submit or stop"
        ;;
esac
