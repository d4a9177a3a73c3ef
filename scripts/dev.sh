#!/usr/bin/env bash
# The README's two commands live here, so CI (.ci/run) and people run exactly the same thing.
#
#   bash scripts/dev.sh demo [args]   set up .venv, then run the main job: tiny DS4 SFT on CPU (verl's SFT trainer, CP=2)
#                                     (scripts/run_ds4_proxy_sft_cpu.sh; args are Hydra overrides)
#   bash scripts/dev.sh test [args]   run the test suite in two lanes (args go to pytest in both):
#                                     lane 1: .venv (PYTHON, megatron-core 0.16.1), every test;
#                                     lane 2: .venv312 (Python 3.12, megatron-core 0.19.2), the layout,
#                                     mcore, engine, resolver and DS4 model tests (tests/conftest.py
#                                     LANE2_FILES; among the tests that args select)
#
# How `test` runs: lane 2 (its set-up, network-bound: torch for Python 3.12 comes from PyPI, then its
# tests) runs in the background at the lowest priority (run_low: a session of its own, nice 19) while
# lane 1 sets up and runs its tests in the foreground. Lane 1 leaves part of the 2 cores idle (its Ray
# and torchrun start-ups wait on each other); lane 2 runs in that slack instead of after lane 1, and
# lane 1 keeps the CPUs it wants. Lane 2's output goes to its log, shown (the failures, or its summary line) once lane 1 is
# done. The summary gives each lane's set-up and test wall time and result; the exit status is
# non-zero if any lane (or the image-pins check) failed.
#
# User-adjustable:
#   PYTHON       interpreter that creates .venv (default: python3; 3.10-3.12)
#   VENV         lane 1's venv folder (default: .venv in the repository root)
#   TORCH_SPEC   torch requirement installed first into .venv (default: torch==2.13.0, whichever build
#                pip finds: the CPU wheel where pip is pointed at one, the CUDA build from the public
#                index on Linux)
#   PINS_CHECK   test: also check that the GPU image's PyPI pins resolve (default 1; 0 skips it)
#   LANES        test: the lanes to run (default "1 2"; "1" or "2" runs one)
#   PYTHON312    lane 2's interpreter (default: python3.12 on PATH, else the newest 3.12 under pyenv);
#                when lane 2 is asked for and no Python 3.12 is found, `test` stops before running
#                anything and says so (install Python 3.12, set PYTHON312, or set LANES=1)
#   VENV312      lane 2's venv folder (default: .venv312)
#   NEMO_AUTOMODEL_SPEC  the DeepSeek-V4.1 reference of the V4.1 tests (default: nemo-automodel==0.7.0),
#                installed with --no-deps after verl-ds4[test]: its wheel declares transformers==5.18.0,
#                megatron-fsdp, torchao, quack-kernels, mistral-common and datasets, which clash with
#                verl 0.9.1's transformers fence (>= 5.5.3, < 5.11), so it cannot be a dependency of the
#                test extra; its deepseek_v41 model modules import with what the extra already installs
#                (docs/ds41-model.md). Empty: not installed (the V4.1 reference tests then skip).
#   BRIDGE312_SPEC Megatron-Bridge for lane 2's production-path tests (default: megatron-bridge==0.6.2), installed
#                with --no-deps beside BRIDGE312_IMPORT_DEPS (the packages `import megatron.bridge` and its value-head
#                hook need): its wheel declares TransformerEngine, flashinfer, nvidia-resiliency-ext and others that need
#                CUDA or clash with the test extra (docs/architecture.md, "The production path on a CPU"). Empty: not
#                installed (the production-path tests then skip, saying so).
#   TORCH312_SPEC torch requirement of lane 2 (default: torch==2.14.1; torch has no CPU build for
#                Python 3.12 on PyPI, so this is the CUDA build, ~550 MB plus its CUDA wheels; it runs
#                on a CPU)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
SELF=$PWD/scripts/dev.sh
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV312=${VENV312:-.venv312}
TORCH312_SPEC=${TORCH312_SPEC:-torch==2.14.1}
NEMO_AUTOMODEL_SPEC=${NEMO_AUTOMODEL_SPEC-nemo-automodel==0.7.0}
BRIDGE312_SPEC=${BRIDGE312_SPEC-megatron-bridge==0.6.2}
# What `import megatron.bridge` (0.6.2) and megatron.bridge.training.utils.train_utils import at module level, found
# by importing them on a fresh lane-2 venv; all pure Python or with wheels on PyPI.
BRIDGE312_IMPORT_DEPS="einops megatron-energon multi-storage-client xattr lark wcmatch bracex braceexpand rapidyaml deprecation filetype webdataset"
LANES=${LANES:-1 2}

# setup VENV PYTHON TORCH_SPEC: create the venv if needed, install torch, then verl-ds4[test] (editable),
# then the V4.1 reference without its dependencies (NEMO_AUTOMODEL_SPEC)
setup() {
    local venv=$1 python=$2 torch_spec=$3
    if [ ! -x "$venv/bin/python" ]; then
        echo "[dev.sh] creating $venv with $python"
        "$python" -m venv "$venv"
    fi
    echo "[dev.sh] installing $torch_spec and verl-ds4[test] into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$torch_spec"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
    if [ -n "$NEMO_AUTOMODEL_SPEC" ]; then
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$NEMO_AUTOMODEL_SPEC"
    fi
    if [ -n "$BRIDGE312_SPEC" ] && [ "$venv" = "$VENV312" ]; then
        # shellcheck disable=SC2086  # BRIDGE312_IMPORT_DEPS: package names, one word each
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$BRIDGE312_SPEC" $BRIDGE312_IMPORT_DEPS
    fi
}

# The Python 3.12 interpreter of lane 2 (empty when there is none).
find_python312() {
    local candidate pyenv_312
    pyenv_312=$(printf '%s\n' "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python | sort -rV)
    # shellcheck disable=SC2086  # pyenv_312: one path a line, no spaces (pyenv's version folders)
    for candidate in "${PYTHON312:-}" python3.12 $pyenv_312; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            command -v "$candidate"
            return
        fi
        if [ -n "${PYTHON312:-}" ] && [ "$candidate" = "$PYTHON312" ]; then
            return  # an explicit PYTHON312 that is not a Python 3.12 is not replaced by a guess
        fi
    done
}

seconds() {  # 75 -> 1m15s
    printf '%dm%02ds' $(($1 / 60)) $(($1 % 60))
}

# versions VENV: "Python 3.11.7, megatron-core 0.16.1, torch 2.13.0+cpu"
versions() {
    "$1/bin/python" - <<'EOF' 2>/dev/null || echo "versions unknown"
import platform
from importlib.metadata import version
print(f"Python {platform.python_version()}, megatron-core {version('megatron-core')}, torch {version('torch')}")
EOF
}

# Last line of a pytest log that is its summary ("=== 420 passed, 3 skipped in 990.12s ===").
pytest_summary() {
    grep -E '^=+ .* in [0-9.]+s' "$1" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//' || true
}

# Lane 2 (`run_tests` starts it as `dev.sh __lane2 LOGS PINS_IN_LANE2 PYTHON312 SECONDS_NOW [pytest args]` under
# run_low): its set-up, then its tests, each writing "EXIT_STATUS SECONDS" to LOGS/*.done (SECONDS on the caller's
# clock), and the pins check when lane 1 does not run.
lane2() {
    local logs=$1 pins_in_lane2=$2 python312=$3 rc pins=""
    SECONDS=$4
    shift 4
    rc=0
    setup "$VENV312" "$python312" "$TORCH312_SPEC" >"$logs/lane2-setup.log" 2>&1 || rc=$?
    echo "$rc $SECONDS" >"$logs/lane2-setup.done"
    [ "$rc" = 0 ] || return 0
    if [ "$pins_in_lane2" = 1 ]; then
        "$VENV312/bin/python" docker/check_pins_resolve.py --timeout 2700 >"$logs/pins.log" 2>&1 &
        pins=$!
    fi
    rc=0
    VERL_DS4_TEST_LANE=2 "$VENV312/bin/python" -m pytest "$@" >"$logs/lane2.log" 2>&1 || rc=$?
    echo "$rc $SECONDS" >"$logs/lane2.done"
    if [ -n "$pins" ]; then
        rc=0
        wait "$pins" || rc=$?
        echo "$rc" >"$logs/pins.done"
    fi
}

# run_low CMD [ARGS]: CMD in a session of its own, at nice 19, and that session's scheduling group at nice 19 too. With
# the kernel's autogroup scheduling on (/proc/sys/kernel/sched_autogroup_enabled, 1 on this project's machines), CPU time
# is shared between sessions first and nice counts only inside a session; the launchers that lane 1's tests start run in
# sessions of their own (a torchrun or Ray job and its children), so lane 2 at plain nice 19 in dev.sh's session still
# took about a third of the CPU from them (measured: two nice-19 busy loops in one session beside two nice-0 ones, each in
# its own session, got 0.34 of a core each; with their session's group at nice 19 they waited until the others ended).
# Where the kernel has no autogroup, the write fails silently and plain nice 19 does the work. Lane 2's own children that
# start sessions of their own (its trainer runs) are back at the default priority. The session's process group is
# stopped with dev.sh (stop_low). Run it in the background (`run_low CMD &`): it replaces that subshell, so $! is the
# session's leader and its process group.
run_low() {
    exec setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || true; exec nice -n 19 "$@"' run_low "$@"
}

LOW_PIDS=""
# On Ctrl-C or TERM: the background sessions (not in the terminal's process group) are stopped too.
stop_low() {
    local pid
    for pid in $LOW_PIDS; do
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
}

run_tests() {
    local lane1=0 lane2=0 lane
    for lane in $LANES; do
        case "$lane" in
            1) lane1=1 ;;
            2) lane2=1 ;;
            *) echo "[dev.sh] LANES='$LANES': each lane is 1 or 2" >&2; exit 2 ;;
        esac
    done
    [ $((lane1 + lane2)) -gt 0 ] || { echo "[dev.sh] LANES is empty: nothing to run" >&2; exit 2; }

    local python312=""
    if [ "$lane2" = 1 ]; then
        python312=$(find_python312)
        if [ -z "$python312" ]; then
            echo "[dev.sh] lane 2 needs Python 3.12, and none was found (${PYTHON312:+PYTHON312=$PYTHON312 is not one; }looked for python3.12 on PATH and ${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12*)." >&2
            echo "[dev.sh] Install Python 3.12, point PYTHON312 at one, or run lane 1 only: LANES=1 bash scripts/dev.sh test" >&2
            exit 2
        fi
    fi

    local logs t_start
    logs=$(mktemp -d)
    t_start=$SECONDS
    local lane2_pid="" t2_start=$SECONDS
    if [ "$lane2" = 1 ]; then
        # The pins check runs from lane 1's venv; from lane 2's when lane 1 is not run.
        local pins_in_lane2=0
        [ "$lane1" = 0 ] && [ "${PINS_CHECK:-1}" = 1 ] && pins_in_lane2=1
        echo "[dev.sh] lane 2: set-up of $VENV312 with $python312, then its tests, in the background at the lowest priority"
        run_low bash "$SELF" __lane2 "$logs" "$pins_in_lane2" "$python312" "$SECONDS" "$@" &
        lane2_pid=$!
        LOW_PIDS="$LOW_PIDS $lane2_pid"
    fi

    # The image's PyPI pins must resolve together (docker/check_pins_resolve.py). The resolve is
    # network-bound (pip fetches ~300 distributions for minutes), so it runs beside the CPU-bound
    # test suite instead of inside it (started by lane 1 after its set-up, or by lane 2 when lane 1
    # is not run); its pytest twin is deselected here. PINS_CHECK=0 skips it.
    local pins_pid=""
    start_pins_check() {
        if [ "${PINS_CHECK:-1}" = 1 ] && [ -z "$pins_pid" ]; then
            # run_low: pip's resolver waits on the network, and its CPU bursts should not slow the tests. At nice 19
            # beside busy cores it may get little CPU (a loaded run ran out of the script's 900 s): its limit is the
            # suite's length, as it only has to finish by the end of lane 1.
            run_low "$1/bin/python" docker/check_pins_resolve.py --timeout 2700 >"$logs/pins.log" 2>&1 &
            pins_pid=$!
            LOW_PIDS="$LOW_PIDS $pins_pid"
        fi
    }

    local status1="" status2="" setup1_s=0 tests1_s=0 setup2_s=0 tests2_s=0 t
    if [ "$lane1" = 1 ]; then
        t=$SECONDS
        setup "$VENV" "$PYTHON" "$TORCH_SPEC"
        setup1_s=$((SECONDS - t))
        start_pins_check "$VENV"
        echo "[dev.sh] lane 1: $(versions "$VENV"): pytest $*"
        t=$SECONDS
        status1=0
        # pytest exits 5 when it collects no test: that fails here as any non-zero exit does. The 20
        # slowest tests are listed at the end (CI's time budget: the whole suite under 40 minutes).
        "$VENV/bin/python" -m pytest --durations=20 \
            --deselect tests/test_image_pins_resolve_on_cpu.py::test_image_pins_resolve_on_python_312 "$@" \
            2>&1 | tee "$logs/lane1.log" || status1=${PIPESTATUS[0]}
        tests1_s=$((SECONDS - t))
    fi

    local setup2_status=""
    if [ "$lane2" = 1 ]; then
        [ -f "$logs/lane2.done" ] || echo "[dev.sh] lane 2: waiting for it to finish (running in the background since the start)"
        wait "$lane2_pid" || true
        local setup_done tests_done
        read -r setup2_status setup_done < "$logs/lane2-setup.done" || { setup2_status=unknown; setup_done=$SECONDS; }
        setup2_s=$((setup_done - t2_start))
        if [ "$setup2_status" != 0 ]; then
            echo "[dev.sh] lane 2: setting up $VENV312 failed (exit $setup2_status); the end of its log:"
            grep -v "^WARNING: Location '" "$logs/lane2-setup.log" | tail -n 20
            status2=$setup2_status
        else
            read -r status2 tests_done < "$logs/lane2.done" || { status2=unknown; tests_done=$SECONDS; }
            tests2_s=$((tests_done - setup_done))
            echo "[dev.sh] lane 2: $(versions "$VENV312"): the lane-2 tests among: pytest $*"
            if [ "$status2" = 0 ]; then
                echo "[dev.sh] lane 2: $(pytest_summary "$logs/lane2.log")"
            else
                # pytest's failure report: from its FAILURES (or ERRORS) section to the end
                sed -n '/^=\{5,\} \(FAILURES\|ERRORS\) =\{5,\}$/,$p' "$logs/lane2.log" | tail -n 300
                grep -q -E '^=+ (FAILURES|ERRORS) =+$' "$logs/lane2.log" || tail -n 60 "$logs/lane2.log"
            fi
            # Exit 5 (no test) with arguments: they selected no lane-2 test; without arguments it fails.
            if [ "$status2" = 5 ] && [ $# -gt 0 ]; then
                status2=none
            fi
        fi
    fi

    local pins_status=""
    if [ -n "$pins_pid" ]; then
        pins_status=0
        wait "$pins_pid" || pins_status=$?
    elif [ -f "$logs/pins.done" ]; then
        read -r pins_status < "$logs/pins.done"
    fi
    if [ -n "$pins_status" ]; then
        echo "[dev.sh] image pins (docker/check_pins_resolve.py, exit $pins_status):"
        tail -n 8 "$logs/pins.log"
    fi

    local status=0 result
    echo "[dev.sh] ------------------------------ summary ------------------------------"
    if [ "$lane1" = 1 ]; then
        result=$([ "$status1" = 0 ] && echo passed || echo "FAILED (exit $status1)")
        echo "[dev.sh] lane 1 ($(versions "$VENV")): set-up $(seconds "$setup1_s"), tests $(seconds "$tests1_s"): $result"
        echo "[dev.sh]        $(pytest_summary "$logs/lane1.log")"
        [ "$status1" = 0 ] || status=1
    fi
    if [ "$lane2" = 1 ]; then
        if [ "$setup2_status" != 0 ]; then
            result="FAILED: set-up exit $setup2_status"
        elif [ "$status2" = none ]; then
            result="no lane-2 test among those selected"
        else
            result=$([ "$status2" = 0 ] && echo passed || echo "FAILED (exit $status2)")
        fi
        echo "[dev.sh] lane 2 ($(versions "$VENV312")): set-up $(seconds "$setup2_s"), tests $(seconds "$tests2_s") (both beside lane 1, at the lowest priority): $result"
        [ -f "$logs/lane2.log" ] && echo "[dev.sh]        $(pytest_summary "$logs/lane2.log")"
        [ "$status2" = 0 ] || [ "$status2" = none ] || status=1
    fi
    if [ -n "$pins_status" ]; then
        echo "[dev.sh] image pins: $([ "$pins_status" = 0 ] && echo resolve || echo "FAILED (exit $pins_status)")"
        [ "$pins_status" = 0 ] || status=1
    fi
    echo "[dev.sh] total $(seconds $((SECONDS - t_start)))"
    rm -rf "$logs"
    exit "$status"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    demo)
        setup "$VENV" "$PYTHON" "$TORCH_SPEC"
        PYTHON="$VENV/bin/python" exec bash scripts/run_ds4_proxy_sft_cpu.sh "$@"
        ;;
    test)
        trap 'stop_low; exit 130' INT
        trap 'stop_low; exit 143' TERM
        run_tests "$@"
        ;;
    __lane2)  # internal: lane 2 of `test`, started by run_tests in a session of its own
        lane2 "$@"
        ;;
    *)
        echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2
        exit 2
        ;;
esac
