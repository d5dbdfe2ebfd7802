#!/usr/bin/env bash
# Zen 3 (AVX2 only): long prompts (32 x 1,900 tokens, 128 out) against vLLM's CPU build in float32, with int4_q8 on
# AVX2 landed, alternated twice.
# usage (repo root, .venv active): bash docs/results/side_by_side/2026-12-03/zen3/q8_avx2/run_long.sh VLLM_PY MODEL_DIR
set -euo pipefail
vllm_python=$1 vllm_model=$2
out=docs/results/side_by_side/2026-12-03/zen3/q8_avx2/long
export VLLM_DTYPE=float32 VLLM_OFFLINE=docs/scripts/vllm_offline_dtype.py
mkdir -p "$out"
{ date -u; uptime; git rev-parse --short HEAD; } > "$out/machine.txt"
cp docs/results/side_by_side/2026-12-01/zen4/long/workload.jsonl "$out/workload.jsonl"
docs/scripts/side_by_side.sh "$vllm_python" "$vllm_model" "$out" 2
