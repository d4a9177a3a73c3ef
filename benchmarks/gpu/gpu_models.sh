#!/usr/bin/env bash
# The GPU run of the project's own models, one command: the device check (benchmarks/gpu/device_check.sh,
# at most 7.5 minutes), then `verl-ds4 verify --device cuda` at CP = 1 (and CP = N when N > 1 GPUs are
# visible), everything written under OUT (default $OUT, else ./gpu_models_out):
#   OUT/device_check/   results.txt, the step logs, env.txt
#   OUT/verify_cuda_cp<N>.txt / .json   the verify tables
#   OUT/summary.txt     device, versions, every PASS/FAIL line, the wall times
# Needs the carried wheels (bash benchmarks/gpu/prepare_carry.sh; carry benchmarks/gpu/carry). Exit 0
# only if everything passed.
set -uo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,10p' "$0"
    exit 0
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-./gpu_models_out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
cd "$repo" || exit 2
summary=$out/summary.txt
: > "$summary"
status=0

start=$SECONDS
bash benchmarks/gpu/device_check.sh --out "$out/device_check" > "$out/device_check.log" 2>&1 || status=1
echo "device check: $((SECONDS - start)) s (limit 450 s)" >> "$summary"
cat "$out/device_check/env.txt" "$out/device_check/results.txt" >> "$summary" 2>/dev/null

# verify needs Megatron-Core: the carried wheel when the machine lacks it
site=$(mktemp -d "${TMPDIR:-/tmp}/verl-ds4-verify-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
if ! "$py" -c 'import megatron.core' 2>/dev/null; then
    "$py" -m pip install --quiet --no-deps --no-index --target "$site" benchmarks/gpu/carry/megatron_core-*.whl \
        >> "$out/verify_setup.log" 2>&1 || echo "FAIL verify setup: no megatron-core wheel (verify_setup.log)" >> "$summary"
fi
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
sizes=(1)
[[ $gpus -gt 1 ]] && sizes+=("$gpus")
for cp in "${sizes[@]}"; do
    start=$SECONDS
    timeout --kill-after=10 300 "$py" -m verl_ds4.cli verify --device cuda --cp "$cp" --json "$out/verify_cuda_cp$cp.json" \
        > "$out/verify_cuda_cp$cp.txt" 2>&1
    rc=$?
    [[ $rc -eq 0 ]] || status=1
    echo "$([[ $rc -eq 0 ]] && echo PASS || echo FAIL) verify --device cuda --cp $cp: exit $rc, $((SECONDS - start)) s" >> "$summary"
done
echo "GPU MODELS: $([[ $status -eq 0 ]] && echo PASS || echo FAIL)" >> "$summary"
cat "$summary"
exit $status
