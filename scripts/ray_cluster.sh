#!/usr/bin/env bash
# Ray cluster launcher for the DS4 RL recipes (PPO with a critic, GRPO).
#
#   bash scripts/ray_cluster.sh [--dry-run] start-head   [ray start args...]   # on the head node
#   bash scripts/ray_cluster.sh [--dry-run] start-worker [ray start args...]   # on every other node
#   bash scripts/ray_cluster.sh [--dry-run] wait-nodes                         # until $NNODES nodes are up
#   bash scripts/ray_cluster.sh [--dry-run] submit {ppo|grpo} [overrides...]   # from any node
#   bash scripts/ray_cluster.sh [--dry-run] stop [--all]                       # on every node
#
# start-head / start-worker start this node as `ray start --block` in the background, owned by a
# process whose PID goes to $RAY_NODE_DIR/ray_start.pid (its output to ray_start.log there), and
# return once Ray reports the node started (else the log's tail, exit 1). `stop` stops the node(s)
# recorded under RAY_NODE_DIR by PID: SIGTERM to the owner (Ray stops its processes), then SIGKILL
# to any process of that node still alive after 20 s; other Ray instances on the host are left
# alone. `stop --all` is `ray stop` (every Ray process of this user on the host). With an explicit
# `--block` (as scripts/slurm_ray_rl.sbatch starts nodes under srun) the node runs in the foreground
# (and says so in its output when `ray start` exits). `wait-nodes` watches the nodes this script started
# on this host (RAY_NODE_DIR) and ends at once, with the node's log tail, when one of them stops.
# Before starting, every command prints the node's address, ports, resources and where its log goes.
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
#   RAY_JOB_ID         submission id (default ds4-<recipe>-<date>-<pid>); a failed job exits with its trainer's status
#   RAY_NO_WAIT        1: return after submitting instead of following the job's logs
#   MAX_RESTARTS       submit: restarts of a driver that dies, by the launcher inside the job, each from the newest
#                      intact checkpoint (default 3; 0: none; docs/checkpoints.md, "Automatic restart")
#   RAY_WAIT_TIMEOUT   seconds wait-nodes waits for $NNODES nodes (default 600)
#   EXTRA_ENV_VARS     more env variable names to carry to the job, space separated
#   RAY_NODE_DIR       this node's PID file and log (default /tmp/verl-ds4-ray/{head,worker}; stop
#                      without it stops both of those)
#   RAY_TEMP_DIR       Ray's --temp-dir on this node (default: Ray's, /tmp/ray); with RAY_NODE_PORTS=auto
#                      a worker takes a fresh folder under it (nodes on one host must not share one)
#   RAY_NODE_PORTS     auto: this node's own services (dashboard agent, runtime-env agent, metrics,
#                      node/object manager, Ray client server) on ports free now and its workers on a
#                      window of RAY_WORKER_PORTS ports free now that no other raylet on this host uses,
#                      all from 20000 up to the kernel's ephemeral range and none of Ray's own defaults
#                      (6379, 8265, 10001, 10002-19999, 52365), so that two nodes can share one host
#                      (scripts/ray_node_ports.py); empty: Ray's defaults
#   RAY_WORKER_PORTS   with RAY_NODE_PORTS=auto: how many worker ports the node's window has (default 200)
#   RAY_START_TIMEOUT  seconds start-head / start-worker wait for the node (default 120)
#   RAY_AUTH_MODE      Ray's token authentication (token | disabled); unset: token when a Ray token is
#                      on this node (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), as
#                      `ray start --head` decides by itself, else disabled; the same for every command
#
# DS4_DEVICE=cpu (rehearsal on a laptop or a CPU cluster): nodes offer NPROC_PER_NODE logical GPUs
# (default 2 on one node, 1 per node on more; verl's CPU platform schedules its processes on them)
# and RAY_NUM_CPUS logical CPUs (default 16), and `submit` runs the CPU PPO/GRPO job
# (scripts/run_ds4_proxy_ppo_cpu.sh, the tiny DS4) on NNODES x NPROC_PER_NODE processes, carrying
# VERL_PLATFORM=cpu and the CPU plugin modules; WORK_DIR must be an absolute path there (the job
# runs in Ray's copy of the checkout).
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
RAY_NODE_DIR=${RAY_NODE_DIR:-}
RAY_TEMP_DIR=${RAY_TEMP_DIR:-}
RAY_NODE_PORTS=${RAY_NODE_PORTS:-}
RAY_WORKER_PORTS=${RAY_WORKER_PORTS:-200}
RAY_START_TIMEOUT=${RAY_START_TIMEOUT:-120}
MAX_RESTARTS=${MAX_RESTARTS:-3}   # submit: the launcher restarts a driver that dies, from the newest intact checkpoint
#########################################################################

ds4_require_device
ds4_require_positive_int GPUS_PER_NODE
ds4_ray_auth_mode
case "$RAY_NODE_PORTS" in
    "" | auto) ;;
    *) ds4_die "RAY_NODE_PORTS=$RAY_NODE_PORTS: expected auto (free ports for this node's services) or empty (Ray's defaults)" ;;
esac
[ "$RAY_NODE_PORTS" = auto ] && ds4_require_positive_int RAY_WORKER_PORTS
[ "$DS4_DEVICE" = cpu ] && RAY_NUM_CPUS=${RAY_NUM_CPUS:-16}

ray_resource_args() {
    if [ "$DS4_DEVICE" = cpu ]; then
        ds4_procs_per_node   # logical GPUs: the CPU platform's Ray resource for its processes
        RESOURCE_ARGS=(--num-gpus="$NPROC_PER_NODE")
    else
        RESOURCE_ARGS=(--num-gpus="$GPUS_PER_NODE")
    fi
    if [ -n "$RAY_NUM_CPUS" ]; then
        ds4_require_positive_int RAY_NUM_CPUS
        RESOURCE_ARGS+=(--num-cpus="$RAY_NUM_CPUS")
    fi
    NODE_TEMP_DIR=$RAY_TEMP_DIR
    if [ "$RAY_NODE_PORTS" = auto ] && [ "$1" = worker ]; then
        # Nodes that share a host must not share a temp dir: each node's runtime-env agent unpacks and
        # deletes the job's working_dir there, under the other node's running workers (seen: a worker
        # whose working directory vanished died in torch's import, "oneMKL FATAL ERROR: Cannot load").
        if [ "$DRY_RUN" = 1 ]; then
            NODE_TEMP_DIR=${RAY_TEMP_DIR:-/tmp/ray}/worker-XXXXXX
        else
            mkdir -p "${RAY_TEMP_DIR:-/tmp/ray}"
            NODE_TEMP_DIR=$(mktemp -d "${RAY_TEMP_DIR:-/tmp/ray}/worker-XXXXXX")
        fi
    fi
    [ -n "$NODE_TEMP_DIR" ] && RESOURCE_ARGS+=(--temp-dir="$NODE_TEMP_DIR")
    if [ "$RAY_NODE_PORTS" = auto ]; then
        # Every component of the node on its own port, none of them one of Ray's defaults: a component
        # left to its default (the worker's Ray client server on 10001) can collide with a drawn one,
        # and Ray then refuses to start the node (scripts/ray_node_ports.py has the list). RAY_PORT /
        # RAY_DASHBOARD_PORT (bound only once the head runs) are left out of the draw.
        local -a ports
        if [ "$DRY_RUN" = 1 ]; then
            ports=(FREE FREE FREE FREE FREE FREE FREE FIRST "FIRST+$((RAY_WORKER_PORTS - 1))")
        else
            local picked
            picked=$("$PYTHON" "$REPO_ROOT/scripts/ray_node_ports.py" 7 "$RAY_WORKER_PORTS" "$RAY_PORT" "$RAY_DASHBOARD_PORT") ||
                ds4_die "RAY_NODE_PORTS=auto: could not pick this node's ports (above)"
            read -r -a ports <<<"$picked"
        fi
        RESOURCE_ARGS+=(--node-manager-port="${ports[0]}" --object-manager-port="${ports[1]}"
            --dashboard-agent-listen-port="${ports[2]}" --dashboard-agent-grpc-port="${ports[3]}"
            --runtime-env-agent-port="${ports[4]}" --metrics-export-port="${ports[5]}"
            --ray-client-server-port="${ports[6]}" --min-worker-port="${ports[7]}" --max-worker-port="${ports[8]}")
    fi
}

node_dir() {  # this node's PID file and log folder
    printf '%s' "${RAY_NODE_DIR:-/tmp/verl-ds4-ray/$1}"
}

# The PID of the `ray start --block` that owns the node in DIR, if it still runs.
node_owner_pid() {
    local dir=$1 pid
    pid=$(cat "$dir/ray_start.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "start.*--block" || return 1
    printf '%s' "$pid"
}

# start_node ROLE RAY_START_ARGS...: in the foreground with --block among the args, else in the
# background under a PID file, returning once the node is up.
start_node() {
    local role=$1
    shift
    local arg
    for arg in "$@"; do
        if [ "$arg" = --block ]; then
            ds4_say "log         this process's output (--block: the node runs in the foreground)"
            local rc=0
            ds4_run ray start "$@" || rc=$?
            [ "$DRY_RUN" = 1 ] || echo "[verl-ds4] the Ray $role on $(hostname -s) stopped: ray start exited with status $rc" >&2
            return "$rc"
        fi
    done
    local dir pid
    dir=$(node_dir "$role")
    ds4_say "log         $dir/ray_start.log (PID file $dir/ray_start.pid; Ray's own logs: ${NODE_TEMP_DIR:-/tmp/ray}/session_latest/logs)"
    if [ "$DRY_RUN" = 1 ]; then
        ds4_print_cmd ray start "$@" --block | sed 's/$/ \&/'
        return
    fi
    if pid=$(node_owner_pid "$dir"); then
        ds4_die "a Ray $role started by this script already runs here (pid $pid, RAY_NODE_DIR=$dir): stop it first (bash scripts/ray_cluster.sh stop) or use another RAY_NODE_DIR"
    fi
    mkdir -p "$dir"
    setsid ray start "$@" --block >"$dir/ray_start.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$dir/ray_start.pid"
    local deadline=$((SECONDS + RAY_START_TIMEOUT))
    until grep -q "Ray runtime started" "$dir/ray_start.log" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid" 2>/dev/null || true
            echo "error: the Ray $role did not start (ray start exited)" >&2
            ds4_log_tail "Ray $role" "$dir/ray_start.log"
            rm -f "$dir/ray_start.pid"
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "error: the Ray $role did not start within ${RAY_START_TIMEOUT}s (RAY_START_TIMEOUT); stopping it" >&2
            ds4_log_tail "Ray $role" "$dir/ray_start.log"
            stop_node "$dir"
            exit 1
        fi
        sleep 0.5
    done
    ds4_say "started     Ray $role (owner pid $pid)"
}

# The processes of a node: its owner and the owner's descendants (Ray's daemons and workers).
node_processes() {
    local root=$1
    ps -e -o pid=,ppid= | awk -v root="$root" '
        { parent[$1] = $2; pids[NR] = $1 }
        END {
            keep[root] = 1; changed = 1
            while (changed) {
                changed = 0
                for (i in pids) { p = pids[i]; if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 } }
            }
            for (p in keep) print p
        }'
}

stop_node() {
    local dir=$1 pid
    if ! pid=$(node_owner_pid "$dir"); then
        rm -f "$dir/ray_start.pid"
        return 1
    fi
    local -a procs
    mapfile -t procs < <(node_processes "$pid")
    ds4_say "stopping    the Ray node of $dir (owner pid $pid, ${#procs[@]} processes)"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 20)) alive p
    while :; do
        alive=()
        for p in "${procs[@]}"; do
            kill -0 "$p" 2>/dev/null && alive+=("$p")
        done
        [ ${#alive[@]} -eq 0 ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            ds4_say "killing     ${#alive[@]} process(es) of that node still alive 20 s after SIGTERM: ${alive[*]}"
            kill -KILL "${alive[@]}" 2>/dev/null || true
            break
        fi
        sleep 0.5
    done
    wait "$pid" 2>/dev/null || true
    rm -f "$dir/ray_start.pid"
}

print_node_plan() {  # role address
    ds4_say "ray $1    address $2, $DS4_DEVICE: ${RESOURCE_ARGS[*]}"
}

command_name=$1
shift
case "$command_name" in
    start-head)
        ray_resource_args head
        ds4_require_free_port RAY_PORT "$RAY_PORT"
        ds4_require_free_port RAY_DASHBOARD_PORT "$RAY_DASHBOARD_PORT"
        # Without RAY_HEAD_IP, Ray picks this node's address itself.
        [ -n "${RAY_HEAD_IP:-}" ] && RESOURCE_ARGS+=(--node-ip-address="$RAY_HEAD_IP")
        ds4_say "ray head    GCS ${RAY_HEAD_IP:-<this node>}:$RAY_PORT, job API http://${RAY_HEAD_IP:-<this node>}:$RAY_DASHBOARD_PORT"
        ds4_say "resources   ${RESOURCE_ARGS[*]}"
        ds4_say "auth        $DS4_RAY_AUTH"
        start_node head --head --port="$RAY_PORT" --dashboard-host=0.0.0.0 \
            --dashboard-port="$RAY_DASHBOARD_PORT" "${RESOURCE_ARGS[@]}" "$@"
        ;;
    start-worker)
        [ -n "${RAY_HEAD_IP:-}" ] || ds4_die "start-worker needs RAY_HEAD_IP, the head node's address (e.g. export RAY_HEAD_IP=10.0.0.1)"
        ray_resource_args worker
        ds4_say "ray worker  joins the head at $RAY_HEAD_IP:$RAY_PORT"
        ds4_say "resources   ${RESOURCE_ARGS[*]}"
        ds4_say "auth        $DS4_RAY_AUTH"
        start_node worker --address="$RAY_HEAD_IP:$RAY_PORT" "${RESOURCE_ARGS[@]}" "$@"
        ;;
    wait-nodes)
        NNODES=${NNODES:-1}
        ds4_require_positive_int NNODES
        ds4_require_positive_int RAY_WAIT_TIMEOUT
        wait_args=(--nodes "$NNODES" --timeout "$RAY_WAIT_TIMEOUT")
        # An explicit GCS address also works from another container on the head node.
        [ -n "${RAY_HEAD_IP:-}" ] && wait_args+=(--address "$RAY_HEAD_IP:$RAY_PORT")
        wait_at="the cluster of this node"
        [ -n "${RAY_HEAD_IP:-}" ] && wait_at="$RAY_HEAD_IP:$RAY_PORT"
        ds4_say "wait        for $NNODES Ray node(s) at $wait_at, at most ${RAY_WAIT_TIMEOUT}s"
        if [ "$DRY_RUN" = 1 ]; then
            ds4_run "$PYTHON" scripts/ray_wait_nodes.py "${wait_args[@]}"
            exit 0
        fi
        # The nodes this script started on this host (RAY_NODE_DIR, else the default head and worker
        # folders) are watched while waiting: one whose `ray start` exits ends the wait at once.
        if [ -n "$RAY_NODE_DIR" ]; then dirs=("$RAY_NODE_DIR"); else dirs=("$(node_dir head)" "$(node_dir worker)"); fi
        watched=()
        for dir in "${dirs[@]}"; do
            node_owner_pid "$dir" >/dev/null && watched+=("$dir")
        done
        "$PYTHON" scripts/ray_wait_nodes.py "${wait_args[@]}" &
        waiter=$!
        # A background job of a script ignores Ctrl-C, so stopping this script (Ctrl-C, SIGTERM, an
        # error) stops the waiter too, instead of leaving it polling for up to RAY_WAIT_TIMEOUT.
        trap 'kill "$waiter" 2>/dev/null || true' EXIT
        trap 'kill "$waiter" 2>/dev/null || true; exit 130' INT
        trap 'kill "$waiter" 2>/dev/null || true; exit 143' TERM
        while kill -0 "$waiter" 2>/dev/null; do
            for dir in "${watched[@]+"${watched[@]}"}"; do
                node_owner_pid "$dir" >/dev/null && continue
                kill "$waiter" 2>/dev/null || true
                echo "error: the Ray node of $dir stopped while waiting for $NNODES node(s) (its ray start exited)" >&2
                ds4_log_tail "Ray node of $dir" "$dir/ray_start.log"
                rm -f "$dir/ray_start.pid"
                exit 1
            done
            sleep 1
        done
        status=0
        wait "$waiter" || status=$?
        exit "$status"
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
        NNODES=${NNODES:-1}
        ds4_require_positive_int NNODES
        ds4_require_restarts
        export MAX_RESTARTS   # a knob of the launcher: it travels in the runtime env
        if [ "$DS4_DEVICE" = cpu ]; then
            # The CPU job: its recipe, process counts and plugin modules travel in the runtime env.
            ds4_procs_per_node
            export DS4_RL_RECIPE=$recipe NNODES NPROC_PER_NODE VERL_PLATFORM=cpu
            if [ -z "${VERL_USE_EXTERNAL_MODULES:-}" ]; then
                VERL_USE_EXTERNAL_MODULES=$(sed -n -E 's/^export VERL_USE_EXTERNAL_MODULES=([A-Za-z0-9_.,]+)$/\1/p' "$REPO_ROOT/$script" | head -n 1)
                export VERL_USE_EXTERNAL_MODULES
            fi
            case "${WORK_DIR:-}" in
                /*) ;;
                *) ds4_die "WORK_DIR='${WORK_DIR:-}': the CPU job on a Ray cluster needs an absolute WORK_DIR on storage every node sees (it runs in Ray's copy of the checkout), e.g. export WORK_DIR=$REPO_ROOT/runs/ds4_ppo_ray" ;;
            esac
            EXTRA_ENV_VARS="${EXTRA_ENV_VARS:-} OMP_NUM_THREADS TOKENIZERS_PARALLELISM"
            export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
        else
            ds4_procs_per_node
        fi
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
        # A known submission id, so that a failed job's own exit status can be read back below.
        RAY_JOB_ID=${RAY_JOB_ID:-ds4-$recipe-$(date +%Y%m%d-%H%M%S)-$$}
        submit_args=(--address="$address" --runtime-env-json="$runtime_env" --submission-id="$RAY_JOB_ID")
        [ "$RAY_NO_WAIT" = 1 ] && submit_args+=(--no-wait)
        ds4_say "submit      $recipe ($DS4_DEVICE): $(ds4_recipe_script "$recipe") to $address"
        ds4_say "processes   $NNODES node(s) x $NPROC_PER_NODE per node"
        ds4_say "restarts    MAX_RESTARTS=$MAX_RESTARTS: the launcher in the job restarts a driver that dies, from the newest intact checkpoint (resume_mode=auto), on this cluster"
        ds4_say "logs        the driver's output follows here (ray job logs <id> --address $address); workers: each node's ${RAY_TEMP_DIR:-/tmp/ray}/session_latest/logs; the job's own: ${WORK_DIR:-WORK_DIR}/logs"
        status=0
        ds4_run ray job submit "${submit_args[@]}" -- bash "$script" "$@" || status=$?
        if [ "$status" != 0 ] && [ "$RAY_NO_WAIT" != 1 ]; then
            # `ray job submit` exits 1 for any failed job: exit with the trainer's own status instead.
            "$PYTHON" "$REPO_ROOT/scripts/ray_job_exit.py" --address "$address" --job-id "$RAY_JOB_ID" || status=$?
        fi
        exit "$status"
        ;;
    stop)
        if [ "${1:-}" = --all ]; then
            shift
            ds4_run ray stop "$@"
            exit 0
        fi
        [ $# -eq 0 ] || ds4_die "stop takes no arguments but --all (got: $*)"
        if [ -n "$RAY_NODE_DIR" ]; then dirs=("$RAY_NODE_DIR"); else dirs=("$(node_dir head)" "$(node_dir worker)"); fi
        if [ "$DRY_RUN" = 1 ]; then
            for dir in "${dirs[@]}"; do ds4_print_cmd kill -TERM "\$(cat $dir/ray_start.pid)"; done
            exit 0
        fi
        stopped=0
        for dir in "${dirs[@]}"; do
            stop_node "$dir" && stopped=$((stopped + 1))
        done
        if [ "$stopped" = 0 ]; then
            ds4_die "no Ray node started by this script runs under ${dirs[*]} (RAY_NODE_DIR); 'stop --all' runs 'ray stop', which stops every Ray process of this user on this host"
        fi
        ;;
    *)
        usage >&2
        ds4_die "unknown command '$command_name': expected start-head, start-worker, wait-nodes, submit or stop"
        ;;
esac
