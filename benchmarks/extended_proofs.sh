#!/usr/bin/env bash
# The extended proofs: the slow end-to-end tests that the README's test command skips (CI's 40-minute budget).
#
# Each is a test marked `@pytest.mark.extended` (verl_ds4/testing/extended.py); CI runs a shorter proof of the
# same thing (docs/benchmarks.md, "Extended proofs", lists which). This runs them with VERL_DS4_EXTENDED=1:
#   lane 1 (.venv):     pytest -m extended            (e.g. the two-node Slurm PPO run, the PPO kill and resume,
#                                                       the comparisons with Megatron-LM dev at the older commit)
#   lane 2 (.venv312):  the same in the lane-2 files  (the production path at the older commit), when .venv312 exists
# and writes the commit, each lane's pytest summary and every test's time to RESULTS (committed).
#
# Usage:  bash benchmarks/extended_proofs.sh                 # both lanes (set up first: bash scripts/dev.sh test)
#         LANES=1 bash benchmarks/extended_proofs.sh         # lane 1 only
#         bash benchmarks/extended_proofs.sh -k slurm        # extra arguments go to pytest in both lanes
# Exit status: 0 when every lane that ran passed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---------------------------------- user-adjustable ----------------------------------
VENV=${VENV:-.venv}                     # lane 1's venv (scripts/dev.sh setup)
VENV312=${VENV312:-.venv312}            # lane 2's venv (Python 3.12); skipped with a note when missing
LANES=${LANES:-1 2}                     # which lanes
RESULTS=${RESULTS:-benchmarks/results/extended_proofs.txt}
PRINTED_LINES=${PRINTED_LINES:-1500}    # how much of what the tests printed goes into RESULTS (the times all do)
# -------------------------------------------------------------------------------------

for lane in $LANES; do
    case "$lane" in
        1|2) ;;
        *) echo "LANES=$LANES: expected 1, 2 or \"1 2\"" >&2; exit 2 ;;
    esac
done
if [ ! -x "$VENV/bin/python" ] && [[ " $LANES " == *" 1 "* ]]; then
    echo "no $VENV/bin/python: set up lane 1 first (bash scripts/dev.sh test, or VENV=... for another venv)" >&2
    exit 2
fi

logs=$(mktemp -d)
status=0
{
    echo "# Extended proofs (bash benchmarks/extended_proofs.sh): the slow tests the README's test command skips"
    echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)'), $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores"
} >"$logs/head.txt"

for lane in $LANES; do
    if [ "$lane" = 1 ]; then
        py="$VENV/bin/python" lane_env=()
    else
        py="$VENV312/bin/python" lane_env=(VERL_DS4_TEST_LANE=2)
        if [ ! -x "$py" ]; then
            echo "lane 2: no $py (bash scripts/dev.sh test sets it up); lane 2 not run" | tee -a "$logs/head.txt"
            continue
        fi
    fi
    echo "[extended] lane $lane: $py -m pytest -m extended $*"
    start=$SECONDS
    rc=0
    env "${lane_env[@]}" VERL_DS4_EXTENDED=1 "$py" -m pytest -m extended -p no:cacheprovider --durations=0 \
        -o console_output_style=classic -s "$@" 2>&1 | tee "$logs/lane$lane.log" || rc=${PIPESTATUS[0]}
    # pytest exits 5 when the lane has no extended test among those selected: nothing to run is not a failure
    [ "$rc" = 5 ] && rc=0
    [ "$rc" = 0 ] || status=1
    echo "lane $lane: exit $rc in $((SECONDS - start)) s: $(grep -E '^=+ .* in [0-9.]+s' \
        "$logs/lane$lane.log" | tail -n 1 | tr -d '=')" >>"$logs/head.txt"
done

mkdir -p "$(dirname "$RESULTS")"
{
    cat "$logs/head.txt"
    for lane in $LANES; do
        [ -f "$logs/lane$lane.log" ] || continue
        echo
        echo "## lane $lane: the tests' times and pytest's summary"
        sed -n '/=\{5,\} slowest durations =\{5,\}/,$p' "$logs/lane$lane.log"
        echo
        echo "## lane $lane: what the tests printed (pytest -s; the first $PRINTED_LINES lines)"
        sed -n '/=\{5,\} slowest durations =\{5,\}/q;p' "$logs/lane$lane.log" | grep -v -E '^\s*$' | head -n "$PRINTED_LINES" || true
    done
} >"$RESULTS"
echo "[extended] report: $RESULTS (exit $status)"
rm -rf "$logs"
exit "$status"
