#!/usr/bin/env bash
# One device check of this repository on a GPU machine that has Python 3.12 and CUDA torch but no
# Megatron, TransformerEngine or verl (see docs/benchmarks.md, "GPU checks").
set -uo pipefail

usage() {
    cat <<'EOF'
usage: benchmarks/gpu/device_check.sh [--out DIR] [--device cuda|cpu] [--quick] [--help]

Runs, each under its own time limit (at most 10 minutes in all: 60 s + 90 s + 60 s + 90 s + 120 s + 150 s):
  1. layout   the CUDA-gated layout/plan tests (pytest -m gpu tests/test_layout_plan_on_cpu.py),
              the balanced-plan sync test among them; on cuda they must run, not skip
  2. thd      benchmarks/bench_thd_layout.py --device DEVICE --without-verl (rows checked
              against verl_ds4 on the CPU)
  3. checks   benchmarks/gpu/device_checks.py --checks attention: DS4 attention forward+backward, bf16
              and fp32, against CPU fp64
     memory   benchmarks/gpu/memory_calibration.py: one training step of a scaled-down DS4 at Flash's
              widths at 2k, 8k and 16k tokens, without and with full recompute: the states and the
              step's peak against the memory model (verl_ds4/memory/peak.py), PASS within 10%; the
              records go to DIR/memory_calibration.json (for memory_calibration.py --compare)
  4. models   benchmarks/gpu/device_checks.py --checks ds4,ds41: the whole tiny DS4 (MTP, indexer loss,
              critic) and V4.1 (Engram, CSA2, mHC) as verify builds them, one THD training step in fp32
              and bf16 (routes replayed, every indexer block kept) against our CPU fp64 models
  5. attention benchmarks/gpu/megatron_dsv4_memory.py: Megatron-LM dev's own two DS4 layers (CSA + HCA, Flash
              widths, dense indexer loss) with dev's unfused sparse attention and with verl-ds4's linear core,
              2k / 8k / 16k / 32k tokens (dev's core OOMs from 16k); records for memory_calibration.py --compare
              in DIR/linear_attention_records.json. Needs benchmarks/gpu/carry/megatron_dev
              (prepare_megatron_dev.sh); skipped without it

Writes DIR/results.txt (one PASS/FAIL line per check), DIR/<step>.log, DIR/env.txt, and prints
a summary. Exit 0 only if everything passed.

  --out DIR     output folder (default: $OUT if set, else ./device_check_out)
  --device D    cuda (default) or cpu (the CPU smoke run of the same steps)
  --quick       smaller benchmark and check sizes (the CPU smoke run uses it)

Environment: PYTHON (default python3) is the interpreter with torch.

What the machine lacks (pytest, megatron-core 0.16.1 for the THD benchmark) comes as wheels in
benchmarks/gpu/carry/ (made by benchmarks/gpu/prepare_carry.sh) and is installed into a temporary
folder with --no-deps --no-index; nothing else is installed, nothing is downloaded.
EOF
}

out_dir=${OUT:-./device_check_out}
device=cuda
quick=0
while [[ $# -gt 0 ]]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --out) out_dir=${2:?--out needs a folder}; shift 2 ;;
        --device) device=${2:?--device needs cuda or cpu}; shift 2 ;;
        --quick) quick=1; shift ;;
        *) echo "device_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if [[ $device != cuda && $device != cpu ]]; then
    echo "device_check: --device must be cuda or cpu, got '$device'" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
results=$out_dir/results.txt
: > "$results"
site=$(mktemp -d "${TMPDIR:-/tmp}/verl-ds4-device-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
cd "$repo" || exit 2

record() {  # record STATUS NAME DETAIL
    echo "$1 $2: $3" | tee -a "$results"
}

# --- what the machine lacks, from the carried wheels ----------------------------------------------
if ! "$py" -c 'import torch' 2>/dev/null; then
    record FAIL setup "$py cannot import torch (set PYTHON to the interpreter that has it)"
    echo "DEVICE CHECK: FAIL"
    exit 1
fi
{
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  device: $device  quick: $quick"
    "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "-")'
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} > "$out_dir/env.txt" 2>&1
cat "$out_dir/env.txt"

need=()
"$py" -c 'import pytest' 2>/dev/null || need+=(pytest pluggy iniconfig pygments)
"$py" -c 'import megatron.core' 2>/dev/null || need+=(megatron_core)
if [[ ${#need[@]} -gt 0 ]]; then
    wheels=()
    for name in "${need[@]}"; do
        matches=(benchmarks/gpu/carry/"${name}"-*.whl)
        found=${matches[0]}
        if [[ ! -f $found ]]; then
            record FAIL setup "no carried wheel for $name in benchmarks/gpu/carry/ (run benchmarks/gpu/prepare_carry.sh and carry that folder)"
        else
            wheels+=("$found")
        fi
    done
    if [[ ${#wheels[@]} -gt 0 ]] && ! "$py" -m pip install --quiet --no-deps --no-index --target "$site" "${wheels[@]}" \
            > "$out_dir/setup.log" 2>&1; then
        record FAIL setup "pip install of the carried wheels failed (setup.log)"
    fi
fi
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"

run_step() {  # run_step NAME LIMIT_S COMMAND...; its output goes to NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" > "$out_dir/$name.log" 2>&1
    rc=$?
    local took=$((SECONDS - start))
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        record FAIL "$name" "ran past ${limit}s (rc $rc; $name.log)"
    elif [[ $rc -ne 0 ]]; then
        record FAIL "$name" "exit $rc after ${took}s ($name.log: $(tail -n 1 "$out_dir/$name.log"))"
    else
        record PASS "$name" "${took}s"
    fi
    return $rc
}

# --- 1. the CUDA-gated layout tests ---------------------------------------------------------------
run_step layout 60 "$py" -m pytest -p no:cacheprovider -m gpu -rs -q tests/test_layout_plan_on_cpu.py \
    --junitxml="$out_dir/layout-junit.xml"
if [[ $device == cuda && -f $out_dir/layout-junit.xml ]]; then
    # On a GPU the CUDA tests must have run: skipped ones mean CUDA was not seen.
    "$py" - "$out_dir/layout-junit.xml" <<'EOF' || record FAIL layout-ran "the CUDA tests did not all run (layout.log)"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
print(f"layout tests: {tests} run, {skipped} skipped")
sys.exit(0 if tests >= 3 and skipped == 0 else 1)
EOF
fi

# --- 2. the THD benchmark, without verl -------------------------------------------------------------
if [[ $quick -eq 1 ]]; then
    thd_args=(--batches 64 --cp 4 --repeats 2)
else
    thd_args=(--batches 64 256 1024 4096 --cp 4 8 --repeats 20)
fi
run_step thd 90 "$py" benchmarks/bench_thd_layout.py --device "$device" --without-verl "${thd_args[@]}"

# --- 3. the numerical checks (DS4 attention, memory calibration) ---------------------------------------
check_args=(--device "$device")
[[ $quick -eq 1 ]] && check_args+=(--quick)
run_step checks 60 "$py" benchmarks/gpu/device_checks.py "${check_args[@]}" --checks attention
grep -E '^(PASS|FAIL) ' "$out_dir/checks.log" | sed 's/^/  /' >> "$results"

# --- 3b. the memory model's calibration: 2k, 8k and 16k tokens, without and with full recompute --------
if [[ $quick -eq 1 ]]; then
    mem_args=(--quick --tokens 64)
else
    mem_args=(--tokens 2048 8192 16384)
fi
run_step memory 90 "$py" benchmarks/gpu/memory_calibration.py --device "$device" "${mem_args[@]}" --recompute none full \
    --json "$out_dir/memory_calibration.json"
grep -E '^(PASS|FAIL) ' "$out_dir/memory.log" | sed 's/^/  /' >> "$results"

# --- 4. the whole models (DS4, V4.1; Megatron-Core from the carried wheel), in their own process ------
run_step models 120 "$py" benchmarks/gpu/device_checks.py "${check_args[@]}" --checks ds4,ds41
grep -E '^(PASS|FAIL) ' "$out_dir/models.log" | sed 's/^/  /' >> "$results"

# --- 5. Megatron-LM dev's own two DS4 layers: its unfused core vs verl-ds4's linear one ---------------
if [[ -f benchmarks/gpu/carry/megatron_dev/megatron/core/transformer/experimental_attention_variant/csa.py ]]; then
    if [[ $quick -eq 1 ]]; then
        attn_args=(--quick --tokens 256)
    else
        attn_args=(--tokens "2048,8192,16384,32768" --budget-s 140)
    fi
    run_step attention 150 "$py" benchmarks/gpu/megatron_dsv4_memory.py --device "$device" "${attn_args[@]}" \
        --kinds pair --recompute none --attention megatron,linear --indexer-loss-coeff 0.001 \
        --out "$out_dir/megatron_dsv4_attention.json" --records "$out_dir/linear_attention_records.json"
else
    record SKIP attention "no Megatron-LM dev export in benchmarks/gpu/carry/megatron_dev (run benchmarks/gpu/prepare_megatron_dev.sh and carry it)"
fi

# --- summary ----------------------------------------------------------------------------------------
echo
echo "==== device check summary ($out_dir/results.txt) ===="
cat "$results"
if grep -q '^FAIL' "$results"; then
    echo "DEVICE CHECK: FAIL"
    exit 1
fi
echo "DEVICE CHECK: PASS"
