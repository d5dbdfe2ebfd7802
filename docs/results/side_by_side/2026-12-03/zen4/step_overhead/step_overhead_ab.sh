#!/bin/bash
# Decode steps, single stream and the 200-request workload on three trees, alternated: A (138e75f: before), B
# (1438196: rotary and the KV write in one call, attention resolved once per step), C (B + prepare in numpy).
# Usage: step_overhead_ab.sh A B C OUT WORKLOAD
A=$1; B=$2; C=$3; OUT=$4; W=$5
mkdir -p $OUT
PY=/work/main/.venv/bin/python
run() { PYTHONPATH=$1 $PY -m pagedllm.entrypoints.cli "${@:2}"; }
cd /tmp
for round in 1 2 3; do for t in $A $B $C; do
  echo "latency round $round $t load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
  run $t bench latency --batch-sizes 1,5 --context-lens 300 --steps 100 --threads 2 --num-speculative-tokens 0 \
    2>&1 | grep '^| [0-9]'
done; done
for round in 1 2 3; do for t in $A $B $C; do
  echo "single stream round $round $t load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
  run $t bench throughput --num-prompts 1 --input-len 16 --output-len 128 --threads 2 \
    --output-json $OUT/single_$(basename $t)_$round.json 2>&1 | grep -i "tokens/s" | head -2
done; done
for round in 1 2; do for t in $A $C; do
  echo "workload round $round $t load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
  run $t bench throughput --dataset file --dataset-path $W --num-prompts 200 --threads 2 \
    --output-json $OUT/workload_$(basename $t)_$round.json 2>&1 | grep -i "tokens/s" | head -2
done; done
