#!/bin/bash
# The 200 requests offline on the commit before against this one, alternated twice (the tail's small steps take the
# 4-bit kernel). Usage: offline_ab.sh OLD_CHECKOUT NEW_CHECKOUT
W=docs/results/side_by_side/2026-12-01/zen4/offline/workload.jsonl
old=$1; new=$2
for round in 1 2; do
  for side in old new; do
    dir=$old; [ $side = new ] && dir=$new
    echo "round $round $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$dir python -m pagedllm.entrypoints.cli bench throughput --dataset file --dataset-path $W \
      --num-prompts 200 --threads 2 2>&1 | grep '^Throughput'
  done
done
