#!/usr/bin/env bash
# The kernel table's row counts smallest first (BASE tree) against coarse to fine (NEW tree) on a random 1B model
# (docs/scripts/random_llama.py), alternated: each tree's own cached table (first measured by `bench kernels`).
# usage: ab_1b.sh BASE NEW GGUF WORKLOAD OUT ROUNDS
set -euo pipefail
base=$1 new=$2 gguf=$3 workload=$4 out=$5 rounds=${6:-2}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for tree in base new; do
        dir=$base; [ $tree = new ] && dir=$new
        echo "== round $round $tree $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/ab.txt"
        PYTHONPATH=$dir python -m pagedllm.entrypoints.cli bench latency --model "$gguf" --batch-sizes 16,40 \
            --context-lens 300 --steps 5 --threads 2 --num-speculative-tokens 0 2>&1 | grep '^| [0-9]' \
            | cut -d'|' -f2,3,6,7,10 | tee -a "$out/ab.txt"
        PYTHONPATH=$dir python -m pagedllm.entrypoints.cli bench throughput --model "$gguf" --dataset file \
            --dataset-path "$workload" --num-prompts "$(wc -l < "$workload")" --threads 2 \
            --output-json "$out/${tree}_$round.json" 2>&1 | grep '^Throughput' | tee -a "$out/ab.txt"
    done
done
