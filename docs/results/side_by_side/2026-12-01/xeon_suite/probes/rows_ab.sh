#!/bin/bash
# bench latency in bf16 (as --dtype auto runs on AMX Xeons), main against the worktree, alternated twice
# usage: bash rows_ab.sh, with /work/main at the commit before and /tmp/rows a worktree of the change
cd /tmp
for round in 1 2; do for tree in /work/main /tmp/rows; do
  echo "round $round $(date +%T) load $(cut -d' ' -f1 /proc/loadavg) $tree"
  PYTHONPATH=$tree PYTHONSAFEPATH=1 python -m pagedllm.entrypoints.cli bench latency --batch-sizes 64 --context-lens 300 --steps 10 --threads 2 --num-speculative-tokens 0 --dtype bfloat16 2>&1 | grep '^| [0-9]\|attention ('
done; done
