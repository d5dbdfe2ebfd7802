#!/usr/bin/env bash
# A first start on a machine, tree against tree, alternated: each run of `pagedllm bench throughput` gets an empty
# PAGEDLLM_CACHE_DIR (no kernel table: the engine measures one, as on a fresh machine or in a container whose cache
# folder does not persist) and prints output tokens/s beside the engine's `kernels (...)` log line.
# usage: docs/scripts/first_start_ab.sh WORKLOAD_JSONL ROUNDS PYTHONPATH...
set -euo pipefail
workload=$1 rounds=$2
shift 2
python=${PYTHON:-python}
for round in $(seq 1 "$rounds"); do
    for tree in "$@"; do
        cache=$(mktemp -d)
        out=$(cd /tmp && PAGEDLLM_CACHE_DIR=$cache PYTHONPATH=$tree "$python" -m pagedllm.entrypoints.cli --log-level INFO bench \
            throughput --dataset file --dataset-path "$workload" --num-prompts "$(wc -l < "$workload")" \
            --threads 2 2>&1)
        echo "round $round $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) $tree:" \
            "$(grep -o 'Throughput:.*' <<< "$out" | head -1)"
        grep -o 'kernels (measured.*' <<< "$out" | head -1
        grep -o 'attention (measured.*' <<< "$out" | head -1 || true
        rm -rf "$cache"
    done
done
