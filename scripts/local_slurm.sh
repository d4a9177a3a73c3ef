#!/usr/bin/env bash
# A real Slurm on this one machine, for rehearsing the cluster launchers (and for the tests).
#
#   sudo bash scripts/local_slurm.sh up       # install (apt) if missing, configure, start, wait until idle
#   export SLURM_CONF=/tmp/verl-ds4-slurm/slurm.conf    # what `up` prints; then sinfo, sbatch, ...
#   bash scripts/slurm_submit.sh sft ...      # DS4_DEVICE=cpu for the CPU jobs, see the README
#   sudo bash scripts/local_slurm.sh down     # cancel its jobs, stop its daemons (by PID), remove nothing else
#   bash scripts/local_slurm.sh status        # what runs, sinfo
#
# `up` (as root): installs Debian's slurm-wlm and munge with apt-get when slurmctld, slurmd or munged
# is missing; writes a key, a slurm.conf (no systemd, no cgroups: proctrack/linuxproc, task/none,
# no accounting) and every state, spool, PID and log file under LOCAL_SLURM_DIR; starts munged on its
# own socket (AuthInfo=socket=..., so a munged of the machine, if any, is neither used nor touched),
# slurmctld and one slurmd per logical node (`slurmd -N NAME`, each on its own port) on free ports;
# waits until `sinfo` shows every node idle. A failed `up` stops what it started. `down` cancels the
# cluster's jobs, waits for them to end, then stops the daemons by the PIDs in their PID files
# (SIGTERM, SIGKILL after 10 s). Nothing outside LOCAL_SLURM_DIR is written, except what apt installs.
#
# Knobs (user-adjustable):
#   LOCAL_SLURM_DIR    state, configuration and logs (default /tmp/verl-ds4-slurm)
#   LOCAL_SLURM_NODES  logical nodes (default 2; all on this host, named ds4n1, ds4n2, ...)
#   LOCAL_SLURM_CPUS   CPUs each node declares (default: this host's CPUs / nodes, at least 1)
#   LOCAL_SLURM_WAIT   seconds `up` waits for the nodes to be idle (default 60)
set -euo pipefail

LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/verl-ds4-slurm}
LOCAL_SLURM_NODES=${LOCAL_SLURM_NODES:-2}
LOCAL_SLURM_CPUS=${LOCAL_SLURM_CPUS:-}
LOCAL_SLURM_WAIT=${LOCAL_SLURM_WAIT:-60}

say() { echo "[local-slurm] $*"; }
die() {
    echo "[local-slurm] error: $*" >&2
    exit 2
}

conf=$LOCAL_SLURM_DIR/slurm.conf
munge_socket=$LOCAL_SLURM_DIR/munge/munge.socket

# A TCP port nobody listens on now (bind test on all addresses).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1]); s.close()'
}

node_names() {
    local i
    for ((i = 1; i <= LOCAL_SLURM_NODES; i++)); do echo "ds4n$i"; done
}

install_if_missing() {
    local missing=()
    local tool
    for tool in munged slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" = 0 ] || die "${missing[*]} not installed and not root: install them (apt-get install -y slurm-wlm munge) or run as root"
    command -v apt-get >/dev/null 2>&1 || die "${missing[*]} not installed and no apt-get: install Slurm and munge with this system's package manager"
    say "installing slurm-wlm and munge with apt-get (missing: ${missing[*]})"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

# PIDs of the daemons this directory's PID files name (munged, slurmctld, slurmd per node).
pid_files() {
    local f
    for f in "$LOCAL_SLURM_DIR"/run/*.pid; do
        [ -f "$f" ] && echo "$f"
    done
    return 0
}

is_ours() {  # PID NAME: the process runs NAME (a PID file may be stale and the PID reused)
    local pid=$1 name=$2 comm
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [ "$comm" = "$name" ]
}

stop_daemons() {
    local f pid name deadline
    local -a pids=()
    for f in $(pid_files); do
        pid=$(cat "$f" 2>/dev/null || true)
        name=$(basename "$f" .pid)
        name=${name%%.*}
        [[ $pid =~ ^[0-9]+$ ]] || continue
        if is_ours "$pid" "$name"; then
            say "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid:$name")
        fi
        rm -f "$f"
    done
    deadline=$((SECONDS + 10))
    local entry left
    while :; do
        left=0
        for entry in "${pids[@]+"${pids[@]}"}"; do
            is_ours "${entry%%:*}" "${entry#*:}" && left=1
        done
        [ "$left" = 0 ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            for entry in "${pids[@]}"; do
                if is_ours "${entry%%:*}" "${entry#*:}"; then
                    say "killing ${entry#*:} (pid ${entry%%:*}): still running 10 s after SIGTERM"
                    kill -KILL "${entry%%:*}" 2>/dev/null || true
                fi
            done
            break
        fi
        sleep 0.2
    done
}

cancel_jobs() {
    [ -f "$conf" ] || return 0
    local pidfile=$LOCAL_SLURM_DIR/run/slurmctld.pid
    [ -f "$pidfile" ] && is_ours "$(cat "$pidfile")" slurmctld || return 0
    local jobs deadline
    jobs=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null || true)
    [ -n "$jobs" ] || return 0
    say "cancelling jobs: $(echo "$jobs" | paste -sd' ' -)"
    # shellcheck disable=SC2086  # one job id per word
    SLURM_CONF=$conf scancel $jobs 2>/dev/null || true
    deadline=$((SECONDS + 30))
    while [ -n "$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null || true)" ] && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.5
    done
}

down() {
    cancel_jobs
    stop_daemons
}

write_config() {
    local hostname cpus ctld_port port name
    hostname=$(hostname -s)
    if [ -z "$LOCAL_SLURM_CPUS" ]; then
        cpus=$(($(nproc) / LOCAL_SLURM_NODES))
        [ "$cpus" -ge 1 ] || cpus=1
    else
        cpus=$LOCAL_SLURM_CPUS
    fi
    ctld_port=$(free_port)
    mkdir -p "$LOCAL_SLURM_DIR"/{run,log,state,spool,munge}
    chmod 700 "$LOCAL_SLURM_DIR/munge"
    cat >"$conf" <<EOF
# Written by scripts/local_slurm.sh: a single-host Slurm for rehearsals and tests.
ClusterName=ds4local
SlurmctldHost=$hostname(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: how long a step credential lives, and so how long Slurm holds a requeued job (default 120 s;
# a requeued job started sooner is killed as "Job credential revoked"). 10 s: rehearse requeues quickly (a step's
# credential is checked by the slurmd on this same host within milliseconds of its creation).
AuthInfo=socket=$munge_socket,cred_expire=10
# Scheduling without the waits of a busy production cluster: a submitted job starts within a second (backfill every
# second, not 30 s; no batch_sched_delay), and a requeued job as soon as its hold ends (the main loop every second:
# by default 60 s, and nothing else wakes the scheduler when a hold ends, so a requeued job waited up to a minute).
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=1
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
LaunchParameters=enable_nss_slurm
# KillWait: seconds between a stopped step's SIGTERM and its SIGKILL. This Slurm tracks processes by parentage
# (proctrack/linuxproc), and torchrun starts its workers in sessions of their own: a torchrun SIGKILLed before it
# stopped its workers leaves them orphaned (seen with 5 s on a loaded machine). 30 s lets it finish.
KillWait=30
StateSaveLocation=$LOCAL_SLURM_DIR/state
SlurmdSpoolDir=$LOCAL_SLURM_DIR/spool/%n
SlurmctldPidFile=$LOCAL_SLURM_DIR/run/slurmctld.pid
SlurmdPidFile=$LOCAL_SLURM_DIR/run/slurmd.%n.pid
SlurmctldLogFile=$LOCAL_SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$LOCAL_SLURM_DIR/log/slurmd.%n.log
EOF
    for name in $(node_names); do
        port=$(free_port)
        mkdir -p "$LOCAL_SLURM_DIR/spool/$name"
        echo "NodeName=$name NodeHostname=$hostname NodeAddr=127.0.0.1 Port=$port CPUs=$cpus RealMemory=1000 State=UNKNOWN" >>"$conf"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$conf"
}

start_munge() {
    local key=$LOCAL_SLURM_DIR/munge/munge.key
    [ -f "$key" ] || dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
    chmod 400 "$key"
    munged --force --socket="$munge_socket" --key-file="$key" --pid-file="$LOCAL_SLURM_DIR/run/munged.pid" \
        --log-file="$LOCAL_SLURM_DIR/log/munged.log" --seed-file="$LOCAL_SLURM_DIR/munge/munged.seed"
}

wait_idle() {
    local deadline=$((SECONDS + LOCAL_SLURM_WAIT)) states=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        states=$(SLURM_CONF=$conf sinfo -h -N -o '%N %t' 2>/dev/null || true)
        if [ -n "$states" ] && [ "$(echo "$states" | awk '$2 == "idle"' | wc -l)" -eq "$LOCAL_SLURM_NODES" ]; then
            return 0
        fi
        sleep 0.5
    done
    echo "[local-slurm] error: the nodes are not idle after ${LOCAL_SLURM_WAIT}s; sinfo says:" >&2
    echo "${states:-<nothing>}" >&2
    local log
    for log in "$LOCAL_SLURM_DIR"/log/*.log; do
        echo "--- last lines of $log:" >&2
        tail -n 15 "$log" >&2
    done
    return 1
}

up_failed() {
    local status=$?
    if [ "$status" != 0 ]; then
        echo "[local-slurm] up failed (exit $status): stopping what it started" >&2
        down
    fi
}

up() {
    [[ $LOCAL_SLURM_NODES =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_NODES must be a positive integer, got '$LOCAL_SLURM_NODES'"
    [ "$(id -u)" = 0 ] || die "up needs root (the daemons run as root in this rehearsal set-up; SlurmUser=root)"
    install_if_missing
    if [ -n "$(pid_files)" ]; then
        die "$LOCAL_SLURM_DIR already has running daemons' PID files: run 'bash scripts/local_slurm.sh down' first (or pick another LOCAL_SLURM_DIR)"
    fi
    trap up_failed EXIT
    write_config
    start_munge
    slurmctld -f "$conf"
    local name
    for name in $(node_names); do
        slurmd -f "$conf" -N "$name"
    done
    wait_idle
    trap - EXIT
    say "up: $LOCAL_SLURM_NODES node(s) idle ($(node_names | paste -sd, -)), partition 'local', all on $(hostname -s)"
    say "export SLURM_CONF=$conf"
}

status() {
    local f pid
    for f in $(pid_files); do
        pid=$(cat "$f")
        if is_ours "$pid" "$(basename "$f" .pid | cut -d. -f1)"; then
            say "$(basename "$f" .pid): pid $pid running"
        else
            say "$(basename "$f" .pid): pid $pid not running"
        fi
    done
    [ -f "$conf" ] && SLURM_CONF=$conf sinfo -N 2>&1 || true
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    -h | --help)
        awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[0]}"
        ;;
    *)
        echo "usage: bash scripts/local_slurm.sh {up|down|status}" >&2
        exit 2
        ;;
esac
