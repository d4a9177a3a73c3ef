#!/usr/bin/env bash
# Download (from PyPI, wheels only, for CPython 3.12 x86_64) what the H200 machine lacks for
# device_check.sh: pytest and its dependencies, and megatron-core 0.16.1 (bench_thd_layout.py
# imports megatron.core.parallel_state and PackedSeqParams; the wheel is ~2.6 MB). The folder,
# benchmarks/gpu/carry/, is git-ignored and goes to the device with the run's `carry` list.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dest=${1:-$here/carry}
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    echo "usage: benchmarks/gpu/prepare_carry.sh [DEST]   (default: benchmarks/gpu/carry)"
    exit 0
fi
mkdir -p "$dest"
# The machine's pip configuration (local wheel dirs, constraints) must not change what is fetched.
env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --index-url https://pypi.org/simple -d "$dest" \
    "megatron-core==0.16.1" "pytest==9.2.0" "pluggy==1.7.0" "iniconfig==2.3.1" "pygments" "packaging>=24.2"
du -sh "$dest"
