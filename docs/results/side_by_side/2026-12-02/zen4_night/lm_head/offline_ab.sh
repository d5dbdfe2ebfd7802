#!/bin/bash
# The 200 held-out requests offline, this change (new) against adfadc1 (old), alternated; each run a first start
# with its own empty cache folder (its kernel table measured in the run's window).
W=/work/main/docs/results/side_by_side/2026-11-30/xeon_fp16/at_87a5b61/offline/workload.jsonl
OUT=${1:-/tmp/lm/offline_ab}  # OLD: a worktree of adfadc1 (git worktree add $OLD adfadc1)
mkdir -p $OUT
cd /tmp
for i in 1 2 3; do
  for side in old new; do
    src=/work/main; [ $side = old ] && src=${OLD:-/tmp/lm/old}
    rm -rf $OUT/cache_$side$i
    echo "== $side $i $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')"
    PAGEDLLM_CACHE_DIR=$OUT/cache_$side$i PYTHONPATH=$src /work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench throughput \
      --dataset file --dataset-path $W --num-prompts 200 --threads 2 2>&1 | grep -E 'Throughput|kernels:|lm_head' | sed 's/^.*pagedllm: //'
  done
done
