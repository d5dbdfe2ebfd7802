#!/usr/bin/env bash
# Zen 3 (AVX2 only) against vLLM's CPU build in float32 (its bf16 is emulated here), offline and through the servers
# at 64 clients, on the 200-request workload W; then long prompts. As docs/scripts/measure_kind.sh, in two parts.
# usage (repo root, .venv active): bash docs/results/side_by_side/2026-12-03/zen3/run_vs_vllm.sh VLLM_PY MODEL_DIR
set -euo pipefail
vllm_python=$1 vllm_model=$2
out=docs/results/side_by_side/2026-12-03/zen3
export VLLM_DTYPE=float32 VLLM_OFFLINE=docs/scripts/vllm_offline_dtype.py
mkdir -p "$out/offline" "$out/serve" "$out/long"
{ date -u; uptime; lscpu; } > "$out/machine.txt"
pagedllm bench kernels --threads 2 > "$out/bench_kernels.txt" 2>&1
cp docs/results/side_by_side/2026-12-01/zen4/offline/workload.jsonl "$out/offline/workload.jsonl"
docs/scripts/side_by_side.sh "$vllm_python" "$vllm_model" "$out/offline" 2
cp "$out/offline/workload.jsonl" "$out/serve/workload.jsonl"
docs/scripts/side_by_side_serve.sh "$vllm_python" "$vllm_model" "$out/serve" 2 64
if [ "${LONG_TOO:-0}" = 1 ]; then
    cp docs/results/side_by_side/2026-12-01/zen4/long/workload.jsonl "$out/long/workload.jsonl"
    docs/scripts/side_by_side.sh "$vllm_python" "$vllm_model" "$out/long" 2
fi
