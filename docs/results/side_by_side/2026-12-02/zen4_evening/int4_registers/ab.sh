#!/bin/bash
# The bf16 4-bit kernel's sums in registers (1-4 rows) against the commit before, alternated three times: a decode
# step at batch 1, 2 and 4 without drafts (bench latency) and the default single stream (bench throughput).
# Usage: ab.sh OLD_CHECKOUT NEW_CHECKOUT (each a checkout of the repository; the venv active).
old=$1; new=$2
for round in 1 2 3; do
  for side in old new; do
    dir=$old; [ $side = new ] && dir=$new
    echo "round $round $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$dir python -m pagedllm.entrypoints.cli bench latency --batch-sizes 1,2,4 --context-lens 300 --steps 40 \
      --threads 2 --num-speculative-tokens 0 2>&1 | grep '^| [0-9]' | cut -d'|' -f2,3,6,10
    PYTHONPATH=$dir python -m pagedllm.entrypoints.cli bench throughput --num-prompts 1 --input-len 16 --output-len 256 \
      --threads 2 2>&1 | grep '^Throughput'
  done
done
