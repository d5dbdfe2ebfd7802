#!/usr/bin/env bash
# `--dtype bfloat16` on a CPU without native bf16 matmuls, before (BASE: a worktree of the commit before) and after
# (this tree), alternated: 32 ShareGPT-like requests, then single-stream and batched decode steps. Run on 2026-11-29
# with ROUNDS="1 2"; round 2's latency part was stopped for time (the before side's takes 8 minutes) and round 2's
# after side ran its throughput part alone, with the same command.
# Usage: [ROUNDS="1 2"] run.sh BASE OUT
set -euo pipefail
export PYTHONSAFEPATH=1  # python -m must not put the working directory before PYTHONPATH (it would run this tree twice)
base=$1 out=$2
mkdir -p "$out"
for round in ${ROUNDS:-1 2}; do
  for side in before after; do
    tree=$([ "$side" = before ] && echo "$base" || echo "$PWD")
    echo "$side round $round $(date -u +%H:%M:%S) $(uptime)" | tee -a "$out/runs.txt"
    PYTHONPATH=$tree python -m pagedllm.entrypoints.cli bench throughput --dataset sharegpt --num-prompts 32 --seed 0 \
      --dtype bfloat16 --threads 2 --output-json "$out/throughput_${side}_$round.json" > "$out/throughput_${side}_$round.txt" 2>&1
    PYTHONPATH=$tree python -m pagedllm.entrypoints.cli bench latency --dtype bfloat16 --batch-sizes 1,8,64 \
      --context-lens 300 --steps 10 --threads 2 --num-speculative-tokens 0 \
      --output-json "$out/latency_${side}_$round.json" > "$out/latency_${side}_$round.txt" 2>&1
  done
done
