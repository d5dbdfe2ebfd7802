#!/bin/bash
# bench latency, batch 1 and 4 at 300 tokens of context, drafts off: A (first tree) and B (second), alternated.
A=$1; B=$2; ROUNDS=${3:-4}
cd /tmp
for round in $(seq $ROUNDS); do
  for tree in $A $B; do
    echo "round $round $tree load $(cut -d' ' -f1 /proc/loadavg) $(date +%H:%M:%S)"
    PYTHONPATH=$tree /work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench latency --batch-sizes 1,4 \
      --context-lens 300 --steps 100 --threads 2 --num-speculative-tokens 0 2>&1 | grep '^| [0-9]'
  done
done
