#!/usr/bin/env bash
# Export Megatron-LM dev's Python package `megatron/core` (no git history, ~10 MiB) from a local
# mirror of NVIDIA/Megatron-LM at a named commit into benchmarks/gpu/carry/megatron_dev/, for
# megatron_dsv4_memory.py on a machine without Megatron-LM. benchmarks/gpu/carry/ is git-ignored;
# pass it in the run's `carry` list. Nothing is downloaded: the mirror must already hold the commit.
#   usage: benchmarks/gpu/prepare_megatron_dev.sh [MIRROR_GIT_DIR] [COMMIT]
# Defaults: MIRROR_GIT_DIR=$MEGATRON_LM_MIRROR or /work/.mirror/NVIDIA+Megatron-LM/repo;
# COMMIT=$MEGATRON_LM_COMMIT or d48bd6be (the dev commit docker/README.md pins);
# destination $MEGATRON_DEV_DEST or benchmarks/gpu/carry/megatron_dev (replaced).
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mirror=${1:-${MEGATRON_LM_MIRROR:-/work/.mirror/NVIDIA+Megatron-LM/repo}}
commit=${2:-${MEGATRON_LM_COMMIT:-d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1}}
dest=${MEGATRON_DEV_DEST:-$here/carry/megatron_dev}
if ! git --git-dir="$mirror" cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "prepare_megatron_dev.sh: commit $commit is not in the git directory $mirror;" \
         "pass a Megatron-LM mirror that has it (fetch github:NVIDIA/Megatron-LM) or another commit." >&2
    exit 2
fi
full=$(git --git-dir="$mirror" rev-parse "$commit^{commit}")
rm -rf "$dest"
mkdir -p "$dest"
git --git-dir="$mirror" archive "$full" megatron/core | tar -x -C "$dest"
echo "$full" > "$dest/COMMIT"
du -sh "$dest"
echo "megatron/core of $full in $dest"
