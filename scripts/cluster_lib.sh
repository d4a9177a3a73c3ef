# shellcheck shell=bash
# Shared helpers of the cluster launchers (scripts/ray_cluster.sh, scripts/slurm_submit.sh,
# scripts/slurm_sft.sbatch, scripts/slurm_ray_rl.sbatch). Sourced, never run on its own.
#
# Conventions:
#   - DRY_RUN=1 (or --dry-run on any launcher): every command is printed as "+ cmd ..." in a form
#     that can be pasted into a shell, and nothing is run, started or submitted.
#   - The recipe knobs are the env variables of the local launchers
#     (scripts/run_deepseek_v4_flash_{sft,ppo,grpo}_megatron.sh); the cluster launchers pass them
#     through the environment and pass extra arguments (Hydra overrides) through "$@".

# The env knobs shared with the local launchers (same names, same meaning).
DS4_RECIPE_KNOBS=(MODEL_PATH TRAIN_FILES VAL_FILES NNODES GPUS_PER_NODE PP EP CP
    ROLLOUT_ENGINE ROLLOUT_TP CKPT_DIR PROJECT_NAME EXP_NAME)

DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
# The device switch: gpu (default) runs the DS4-Flash recipes' launchers on GPUs; cpu runs the CPU
# jobs (the tiny DS4: scripts/run_ds4_proxy_sft_cpu.sh, scripts/run_ds4_proxy_ppo_cpu.sh) through the
# same batch scripts, rendezvous and Ray cluster. It changes the device, the local launcher and the
# process counts (NPROC_PER_NODE CPU processes, logical Ray GPUs), nothing else.
DS4_DEVICE=${DS4_DEVICE:-gpu}

ds4_die() {
    echo "error: $*" >&2  # error-catalogue: the die helper itself; its callers are the sites
    exit 2
}

# Print a launcher's header comment (its usage text), without the shebang and #SBATCH lines.
ds4_print_header() {
    awk 'NR == 1 { next } /^#SBATCH/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1"
}

# Quote one word for display so the printed line can be pasted into bash.
ds4_quote() {
    local s=$1
    if [[ -n $s && $s =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$s"
    else
        printf "'%s'" "${s//\'/\'\\\'\'}"
    fi
}

# Print a command as "+ word word ..." (DS4_PRINT_PREFIX, e.g. an indent, goes in front).
ds4_print_cmd() {
    local word
    printf '%s+' "${DS4_PRINT_PREFIX:-}"
    for word in "$@"; do
        printf ' '
        ds4_quote "$word"
    done
    printf '\n'
}

# Run a command, or print it under DRY_RUN=1.
ds4_run() {
    if [ "$DRY_RUN" = 1 ]; then
        ds4_print_cmd "$@"
    else
        "$@"
    fi
}

# Export NAME=VALUE for the commands that follow (printed as an export line under DRY_RUN=1).
ds4_export() {
    local name=$1 value=$2
    export "$name=$value"
    if [ "$DRY_RUN" = 1 ]; then
        ds4_print_cmd export "$name=$value"
    fi
}

ds4_require_positive_int() {
    local name=$1 value=${!1:-}
    if ! [[ $value =~ ^[1-9][0-9]*$ ]]; then
        ds4_die "$name must be a positive integer, got '${value}' (e.g. export $name=4)"
    fi
}

# The restart budget MAX_RESTARTS: a non-negative integer (verl_ds4.recipes.supervise checks it again where it runs).
ds4_require_restarts() {
    [[ ${MAX_RESTARTS:-} =~ ^[0-9]+$ ]] ||
        ds4_die "MAX_RESTARTS='${MAX_RESTARTS:-}': expected a non-negative integer, the restarts allowed after the run dies (e.g. export MAX_RESTARTS=3; 0 stops at the first failure); nothing was submitted or started"
}

ds4_say() {
    echo "[verl-ds4] $*"
}

ds4_require_device() {
    case "$DS4_DEVICE" in
        gpu | cpu) ;;
        *) ds4_die "DS4_DEVICE=$DS4_DEVICE: expected gpu (the default) or cpu (the tiny DS4 CPU jobs, for rehearsals)" ;;
    esac
}

# Local launcher of a recipe, relative to the repository root (DS4_DEVICE=cpu: the CPU job's).
ds4_recipe_script() {
    case "$DS4_DEVICE:$1" in
        gpu:sft | gpu:ppo | gpu:grpo) printf 'scripts/run_deepseek_v4_flash_%s_megatron.sh' "$1" ;;
        cpu:sft) printf 'scripts/run_ds4_proxy_sft_cpu.sh' ;;
        cpu:ppo | cpu:grpo) printf 'scripts/run_ds4_proxy_ppo_cpu.sh' ;;
        *) ds4_die "unknown recipe '$1': expected one of sft, ppo, grpo" ;;
    esac
}

# Processes (torchrun ranks, Ray logical GPUs) per node into NPROC_PER_NODE: GPUS_PER_NODE on GPUs;
# on CPUs NPROC_PER_NODE (default: the CPU main job's 2 processes spread over the nodes: 2 on one
# node, 1 per node on more).
ds4_procs_per_node() {
    if [ "$DS4_DEVICE" = cpu ]; then
        if [ -z "${NPROC_PER_NODE:-}" ]; then
            NPROC_PER_NODE=1
            [ "${NNODES:-1}" = 1 ] && NPROC_PER_NODE=2
        fi
        ds4_require_positive_int NPROC_PER_NODE
    else
        if [ -n "${NPROC_PER_NODE:-}" ] && [ "$NPROC_PER_NODE" != "$GPUS_PER_NODE" ]; then
            ds4_die "NPROC_PER_NODE=$NPROC_PER_NODE but GPUS_PER_NODE=$GPUS_PER_NODE: on GPUs there is one process per GPU (unset NPROC_PER_NODE; it is for DS4_DEVICE=cpu)"
        fi
        NPROC_PER_NODE=$GPUS_PER_NODE
    fi
}

# The knobs a GPU job cannot run without (the local launchers' defaults point into $HOME, which on a
# cluster is rarely where the checkpoint and data are): refused before any node starts.
ds4_require_job_knobs() {
    [ "$DS4_DEVICE" = gpu ] && [ "$DRY_RUN" != 1 ] || return 0
    local name
    for name in MODEL_PATH TRAIN_FILES; do
        if [ -z "${!name:-}" ]; then
            ds4_die "$name is not set: a GPU job needs it on every node (e.g. export MODEL_PATH=/ckpt/DeepSeek-V4-Flash TRAIN_FILES=/data/train.parquet); nothing was submitted or started"
        fi
    done
}

# Refuse a TCP port that something on this host listens on (or that cannot be bound).
ds4_require_free_port() {
    local name=$1 port=$2 where=${3:-$(hostname -s)}
    [ "$DRY_RUN" = 1 ] && return 0
    [[ $port =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] ||
        ds4_die "$name=$port is not a TCP port (expected 1-65535)"
    local why
    # SO_REUSEADDR as the servers set it (torchrun's TCPStore, Ray's GCS): a port whose last
    # connections wait in TIME_WAIT (a job just cancelled) is free; one something listens on is not.
    if ! why=$("$PYTHON" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError as e:
    print(e.strerror or e); sys.exit(1)
finally:
    s.close()' "$port" 2>&1); then
        ds4_die "$name=$port is in use on $where ($why): pick a free port (export $name=...) or stop what listens there"
    fi
}

# Ray's token authentication, the same for every node and client of the cluster. Ray 2.60's
# `ray start --head` turns it on by itself when a token file exists (~/.ray/auth_token, which a local
# `ray.init()` writes), while `ray start --address` and clients do not: a worker then fails with
# "InvalidAuthToken". So unless RAY_AUTH_MODE is set, it is set here to what the head will do: token
# when RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH's file or ~/.ray/auth_token exists (every node needs that
# token), disabled otherwise. Exported for the commands that follow; DS4_RAY_AUTH says why.
ds4_ray_auth_mode() {
    if [ -n "${RAY_AUTH_MODE:-}" ]; then
        DS4_RAY_AUTH="$RAY_AUTH_MODE (RAY_AUTH_MODE)"
    elif [ -n "${RAY_AUTH_TOKEN:-}" ]; then
        RAY_AUTH_MODE=token DS4_RAY_AUTH="token (RAY_AUTH_TOKEN)"
    elif [ -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]; then
        RAY_AUTH_MODE=token DS4_RAY_AUTH="token (${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} exists, and ray start --head would enable it)"
    else
        RAY_AUTH_MODE=disabled DS4_RAY_AUTH="disabled (no Ray token on this node)"
    fi
    export RAY_AUTH_MODE DS4_RAY_AUTH
}

# The last lines of a node's log, framed, for a failure report.
ds4_log_tail() {
    local label=$1 log=$2 lines=${3:-40}
    echo "[verl-ds4] ---- $label: last $lines lines of $log ----" >&2
    if [ -f "$log" ]; then
        tail -n "$lines" "$log" >&2
    else
        echo "(no log: the node never started its task)" >&2
    fi
    echo "[verl-ds4] ---- end of $label ----" >&2
}

# Check that a recipe's local launcher exists (skipped under DRY_RUN=1, which runs nothing).
ds4_require_recipe_script() {
    local root=$1 script=$2
    if [ "$DRY_RUN" != 1 ] && [ ! -f "$root/$script" ]; then
        ds4_die "$root/$script not found: the local launcher of this recipe is missing from this checkout"
    fi
}

# Python modules that carry the verl-ds4 plugin: $VERL_USE_EXTERNAL_MODULES when set, else the modules
# named by our `verl.plugins` entry points in pyproject.toml, else the package itself. verl imports
# these in every process (Ray workers included) when VERL_USE_EXTERNAL_MODULES names them, which
# also covers nodes where the package runs from a shipped working_dir rather than an installed wheel.
ds4_plugin_modules() {
    local root=$1
    if [ -n "${VERL_USE_EXTERNAL_MODULES:-}" ]; then
        printf '%s' "$VERL_USE_EXTERNAL_MODULES"
        return
    fi
    local modules
    modules=$(awk '
        /^\[/ { in_group = ($0 ~ /^\[project\.entry-points\."verl\.plugins"\]/); next }
        in_group && /=/ {
            value = $0; sub(/^[^=]*=[ \t]*/, "", value); gsub(/["\047 \t]/, "", value)
            sub(/:.*/, "", value); if (value != "") print value
        }' "$root/pyproject.toml" 2>/dev/null | paste -sd, -)
    printf '%s' "${modules:-verl_ds4}"
}

# Knobs of a local launcher: the names it reads as NAME=${NAME:-...} / NAME=${NAME-...}, except
# PYTHON (an interpreter path of the submitting host, not of the cluster nodes). A launcher that
# runs another one (a `# delegates-to: FILE` line, FILE beside it) has that one's knobs too.
ds4_launcher_knobs() {
    local launcher=$1 delegate
    [ -f "$launcher" ] || return 0
    sed -n -E 's/^([A-Z][A-Z0-9_]*)=\$\{\1:?-.*/\1/p' "$launcher" | grep -v -x PYTHON || true
    delegate=$(sed -n -E 's/^# delegates-to: ([A-Za-z0-9_.-]+)$/\1/p' "$launcher" | head -n 1)
    if [ -n "$delegate" ]; then
        ds4_launcher_knobs "$(dirname "$launcher")/$delegate"
    fi
}

# Names of the env variables a cluster job carries to every node: the recipe knobs and the local
# launcher's own knobs that are set here, every VERL_* and NCCL_* variable, and the names listed
# in EXTRA_ENV_VARS (space separated).
ds4_job_env_names() {
    local launcher=${1:-} name
    for name in "${DS4_RECIPE_KNOBS[@]}" $(ds4_launcher_knobs "$launcher"); do
        if [ -n "${!name+x}" ]; then echo "$name"; fi
    done
    compgen -v | grep -E '^(VERL_|NCCL_)' || true
    for name in ${EXTRA_ENV_VARS:-}; do echo "$name"; done
}

# Ray runtime env (JSON) for `ray job submit`: working_dir ships this checkout (launchers, recipes,
# configs and the verl_ds4 sources) to every node, env_vars carry the knobs and the plugin modules.
# Arguments: working_dir (empty: none), plugin modules, the recipe's local launcher (for its knobs).
# Under DRY_RUN=1 values of secret-looking variables (*KEY*, *TOKEN*, *SECRET*, *PASSWORD*) are masked.
ds4_ray_runtime_env_json() {
    local working_dir=$1 plugin_modules=$2 launcher=${3:-}
    local -a names
    local name
    for name in ${EXTRA_ENV_VARS:-}; do
        [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || ds4_die "EXTRA_ENV_VARS: '$name' is not an env variable name (expected names separated by spaces, e.g. EXTRA_ENV_VARS=\"HF_HOME WANDB_API_KEY\")"
    done
    mapfile -t names < <(ds4_job_env_names "$launcher" | sort -u)
    DS4_WORKING_DIR=$working_dir DS4_PLUGIN_MODULES=$plugin_modules DS4_MASK=$DRY_RUN \
        "$PYTHON" - "${names[@]}" <<'PY'
import json
import os
import re
import sys

env = {name: os.environ[name] for name in sys.argv[1:] if name in os.environ}
env["VERL_USE_EXTERNAL_MODULES"] = os.environ["DS4_PLUGIN_MODULES"]
if os.environ.get("DS4_MASK") == "1":
    secret = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
    env = {k: ("***" if secret.search(k) else v) for k, v in env.items()}
runtime_env = {"env_vars": dict(sorted(env.items()))}
if os.environ["DS4_WORKING_DIR"]:
    runtime_env["working_dir"] = os.environ["DS4_WORKING_DIR"]
    runtime_env["excludes"] = [".git", ".venv", ".venv*", "**/__pycache__", "checkpoints", "outputs", "runs", "wandb"]
print(json.dumps(runtime_env, separators=(",", ":")))
PY
}

# Split "$@" into the launcher's own flags and the pass-through arguments.
# Sets DRY_RUN, DS4_HELP and the array DS4_ARGS. `--dry-run` and `-h/--help` are ours anywhere
# before a literal `--`; everything after `--` is passed through untouched (e.g. a recipe's own
# --dry-run: `... submit ppo -- --dry-run`).
# shellcheck disable=SC2034  # DS4_ARGS and DS4_HELP are read by the calling launcher
ds4_parse_common_args() {
    DS4_ARGS=()
    DS4_HELP=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --dry-run) DRY_RUN=1 ;;
            -h | --help) DS4_HELP=1 ;;
            --)
                shift
                DS4_ARGS+=("$@")
                break
                ;;
            *) DS4_ARGS+=("$1") ;;
        esac
        shift
    done
    export DRY_RUN
}

# ------------------------------------------------------------------------------------------------
# Slurm helpers (used inside the batch scripts).

# Host names of the allocation into the array DS4_HOSTS. Under DRY_RUN=1 nothing is queried:
# the hosts are placeholders node1..node$NNODES.
ds4_slurm_hosts() {
    DS4_HOSTS=()
    if [ "$DRY_RUN" = 1 ]; then
        local i
        for ((i = 1; i <= NNODES; i++)); do DS4_HOSTS+=("node$i"); done
        return
    fi
    [ -n "${SLURM_JOB_NODELIST:-}" ] || ds4_die "not inside a Slurm allocation (no SLURM_JOB_NODELIST): submit with scripts/slurm_submit.sh, or pass --dry-run"
    local hosts
    # scontrol passes a malformed range (node[1-) through as one "host": brackets left mean it did not parse.
    if ! hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>&1) || [ -z "$hosts" ] || grep -q '[][,]' <<<"$hosts"; then
        ds4_die "cannot parse the node list SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST' (scontrol show hostnames: ${hosts:-no host}): expected a Slurm host list such as node[1-4],gpu7"
    fi
    mapfile -t DS4_HOSTS <<<"$hosts"
    [ "${#DS4_HOSTS[@]}" -eq "$NNODES" ] || ds4_die "the node list '$SLURM_JOB_NODELIST' has ${#DS4_HOSTS[@]} nodes but NNODES=$NNODES: submit with --nodes=$NNODES or leave NNODES unset"
}

# The address of a node of the allocation as Slurm reaches it (its NodeAddr; the name itself when
# Slurm has no other), into DS4_NODE_ADDR. Under DRY_RUN=1 the name is used.
# shellcheck disable=SC2034  # DS4_NODE_ADDR is read by the calling batch script
ds4_slurm_node_addr() {
    local node=$1 line
    DS4_NODE_ADDR=$node
    [ "$DRY_RUN" = 1 ] && return 0
    line=$(scontrol show node -o "$node" 2>/dev/null || true)
    if [[ $line =~ (^|[[:space:]])NodeAddr=([^[:space:]]+) ]]; then
        DS4_NODE_ADDR=${BASH_REMATCH[2]}
    fi
}

# Node count and GPUs per node of the job: the allocation's when inside one, else the knobs.
# A knob that disagrees with the allocation is an error, never silently replaced.
ds4_slurm_size() {
    if [ -n "${SLURM_JOB_NUM_NODES:-}" ]; then
        if [ -n "${NNODES:-}" ] && [ "$NNODES" != "$SLURM_JOB_NUM_NODES" ]; then
            ds4_die "NNODES=$NNODES but the Slurm allocation has $SLURM_JOB_NUM_NODES nodes: make them agree (sbatch --nodes=$NNODES)"
        fi
        NNODES=$SLURM_JOB_NUM_NODES
    fi
    NNODES=${NNODES:-1}
    GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
    ds4_require_positive_int NNODES
    ds4_require_positive_int GPUS_PER_NODE
}

# pyxis/enroot arguments for srun from CONTAINER_IMAGE / CONTAINER_MOUNTS / CONTAINER_WORKDIR,
# into the array DS4_CONTAINER_ARGS (empty without CONTAINER_IMAGE).
ds4_container_args() {
    DS4_CONTAINER_ARGS=()
    if [ -n "${CONTAINER_IMAGE:-}" ]; then
        DS4_CONTAINER_ARGS+=(--container-image="$CONTAINER_IMAGE"
            --container-workdir="${CONTAINER_WORKDIR:-/opt/verl-ds4}")
        if [ -n "${CONTAINER_MOUNTS:-}" ]; then
            DS4_CONTAINER_ARGS+=(--container-mounts="$CONTAINER_MOUNTS")
        fi
    fi
}

DS4_BG_PIDS=()

# ds4_srun_step [--bg] SRUN_OPTIONS... -- COMMAND...
# Runs `srun SRUN_OPTIONS... <container args> COMMAND...` (in the background with --bg). Under
# DRY_RUN=1 it prints the line and, when COMMAND is `bash scripts/ray_cluster.sh ...` (or
# `bash -c '...' scripts/ray_cluster.sh ...`), the commands that launcher would run on the node,
# indented below it.
ds4_srun_step() {
    local bg=0
    if [ "${1:-}" = --bg ]; then
        bg=1
        shift
    fi
    local -a opts=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        opts+=("$1")
        shift
    done
    [ "${1:-}" = -- ] || ds4_die "ds4_srun_step: missing -- before the command"  # error-catalogue: internal: a launcher called the helper wrongly
    shift
    local -a cmd=(srun "${opts[@]}" "${DS4_CONTAINER_ARGS[@]+"${DS4_CONTAINER_ARGS[@]}"}" "$@")
    if [ "$DRY_RUN" = 1 ]; then
        if [ "$bg" = 1 ]; then
            ds4_print_cmd "${cmd[@]}" | sed 's/$/ \&/'
        else
            ds4_print_cmd "${cmd[@]}"
        fi
        if [ "${1:-}" = bash ] && [ "${2:-}" = scripts/ray_cluster.sh ]; then
            DS4_PRINT_PREFIX="${DS4_PRINT_PREFIX:-}    " bash scripts/ray_cluster.sh --dry-run "${@:3}"
        elif [ "${1:-}" = bash ] && [ "${2:-}" = -c ] && [ "${4:-}" = scripts/ray_cluster.sh ]; then
            # A wrapper (bash -c '...' scripts/ray_cluster.sh ARGS) around the launcher.
            DS4_PRINT_PREFIX="${DS4_PRINT_PREFIX:-}    " bash scripts/ray_cluster.sh --dry-run "${@:5}"
        fi
    elif [ "$bg" = 1 ]; then
        "${cmd[@]}" &
        DS4_BG_PIDS+=($!)
    else
        "${cmd[@]}"
    fi
}

# Stop the background steps this script started (srun passes SIGTERM to its tasks and their Slurm
# steps end with them), and wait up to 30 s for them to end.
ds4_stop_bg_steps() {
    local pid deadline=$((SECONDS + 30))
    for pid in "${DS4_BG_PIDS[@]+"${DS4_BG_PIDS[@]}"}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${DS4_BG_PIDS[@]+"${DS4_BG_PIDS[@]}"}"; do
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
    done
}

# After a node-per-task step: the tail of node 0's log when every node succeeded (its console
# summary); else the log tail of every node whose task failed (first) or was stopped before it
# reported (srun ends the other tasks once one fails). Exits with the first failed node's status
# (the step's when no node reported one).
ds4_report_nodes() {
    local dir=$1 status=$2 i rc first=""
    local -a failed_nodes=() stopped_nodes=()
    for ((i = 0; i < NNODES; i++)); do
        rc=$(cat "$dir/node$i.status" 2>/dev/null || echo none)
        if [ "$rc" = none ]; then
            stopped_nodes+=("$i")
        elif [ "$rc" != 0 ]; then
            failed_nodes+=("$i")
            [ -n "$first" ] || first=$rc
        fi
    done
    if [ ${#failed_nodes[@]} -eq 0 ] && [ ${#stopped_nodes[@]} -eq 0 ] && [ "$status" = 0 ]; then
        ds4_say "all $NNODES node(s) finished; node 0's log ends:"
        tail -n 20 "$dir/node0.log"
        return 0
    fi
    for i in "${failed_nodes[@]+"${failed_nodes[@]}"}"; do
        echo "[verl-ds4] node $i (${DS4_HOSTS[$i]:-?}) failed: exit status $(cat "$dir/node$i.status")" >&2
        ds4_log_tail "node $i (${DS4_HOSTS[$i]:-?})" "$dir/node$i.log"
    done
    for i in "${stopped_nodes[@]+"${stopped_nodes[@]}"}"; do
        echo "[verl-ds4] node $i (${DS4_HOSTS[$i]:-?}) was stopped before it finished (srun ends every task once one fails; or the job was cancelled)" >&2
        ds4_log_tail "node $i (${DS4_HOSTS[$i]:-?})" "$dir/node$i.log" 15
    done
    status=${first:-$status}
    [ "$status" != 0 ] || status=1
    echo "[verl-ds4] FAILED (exit $status); node logs: $dir" >&2
    exit "$status"
}
