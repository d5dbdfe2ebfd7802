#!/usr/bin/env bash
# Zen 3 (AVX2 only) against vLLM's CPU build in float32 with int4_q8 on AVX2 landed: the 200 requests offline, then
# (SERVE=1) through the servers at 64 clients. `pagedllm bench kernels` first (a new build: its table is measured afresh).
# usage (repo root, .venv active): bash docs/results/side_by_side/2026-12-03/zen3/q8_avx2/run_vs_vllm.sh VLLM_PY MODEL_DIR
set -euo pipefail
vllm_python=$1 vllm_model=$2
out=docs/results/side_by_side/2026-12-03/zen3/q8_avx2
export VLLM_DTYPE=float32 VLLM_OFFLINE=docs/scripts/vllm_offline_dtype.py
mkdir -p "$out/offline" "$out/serve"
pagedllm bench kernels --threads 2 > "$out/bench_kernels.txt" 2>&1
cp docs/results/side_by_side/2026-12-03/zen3/offline/workload.jsonl "$out/offline/workload.jsonl"
docs/scripts/side_by_side.sh "$vllm_python" "$vllm_model" "$out/offline" 2
if [ "${SERVE:-0}" = 1 ]; then
    cp "$out/offline/workload.jsonl" "$out/serve/workload.jsonl"
    docs/scripts/side_by_side_serve.sh "$vllm_python" "$vllm_model" "$out/serve" 2 64
fi
