#!/usr/bin/env bash
# The README's two commands live here, so CI (.ci/run) and people run exactly the same thing.
#
#   bash scripts/dev.sh demo [args]   set up .venv, then run the main job: tiny DS4-proxy SFT on CPU
#                                     (scripts/run_ds4_proxy_sft_cpu.sh; args are Hydra overrides)
#   bash scripts/dev.sh test [args]   set up .venv, then run the test suite (args go to pytest)
#
# User-adjustable:
#   PYTHON       interpreter that creates the venv (default: python3; 3.10-3.12)
#   VENV         venv folder (default: .venv in the repository root)
#   PINS_CHECK   test: also check that the GPU image's PyPI pins resolve (default 1; 0 skips it)
#   TORCH_SPEC   torch requirement installed first (default: torch==2.13.0, whichever build pip finds:
#                the CPU wheel where pip is pointed at one, the CUDA build from the public index on Linux)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[dev.sh] creating $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
    fi
    echo "[dev.sh] installing $TORCH_SPEC and verl-ds4[test] into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    demo)
        setup
        PYTHON="$VENV/bin/python" exec bash scripts/run_ds4_proxy_sft_cpu.sh "$@"
        ;;
    test)
        setup
        # The image's PyPI pins must resolve together (docker/check_pins_resolve.py). The resolve is
        # network-bound (pip fetches ~300 distributions for minutes), so it runs beside the CPU-bound
        # test suite instead of inside it; its pytest twin is deselected here. PINS_CHECK=0 skips it.
        pins_pid=""
        pins_log=$(mktemp)
        if [ "${PINS_CHECK:-1}" = 1 ]; then
            "$VENV/bin/python" docker/check_pins_resolve.py >"$pins_log" 2>&1 &
            pins_pid=$!
        fi
        status=0
        # pytest exits 5 when it collects no test: that fails here as any non-zero exit does.
        "$VENV/bin/python" -m pytest \
            --deselect tests/test_image_pins_resolve_on_cpu.py::test_image_pins_resolve_on_python_312 "$@" || status=$?
        if [ -n "$pins_pid" ]; then
            pins_status=0
            wait "$pins_pid" || pins_status=$?
            echo "[dev.sh] image pins (docker/check_pins_resolve.py, exit $pins_status):"
            tail -n 8 "$pins_log"
            [ "$pins_status" = 0 ] || status=$pins_status
        fi
        rm -f "$pins_log"
        exit "$status"
        ;;
    *)
        echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2
        exit 2
        ;;
esac
