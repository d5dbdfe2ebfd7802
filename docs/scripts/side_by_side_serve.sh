#!/usr/bin/env bash
# pagedllm's and vLLM's CPU build's OpenAI servers on the same requests, alternated: each server started alone, then
# `pagedllm bench serve` sends the workload's requests (streamed, greedy, ignore_eos, exactly output_len tokens
# each) with at most CONCURRENCY in flight, all arrived at once; the server is stopped before the other one starts.
# usage: docs/scripts/side_by_side_serve.sh VLLM_PYTHON VLLM_MODEL_DIR OUT_DIR [ROUNDS] [CONCURRENCY]
#   VLLM_DTYPE=float32 runs vLLM in fp32 (its bf16 is emulated, slow, on CPUs without AVX512-BF16).
#   OUT_DIR/workload.jsonl is written as docs/scripts/side_by_side.sh writes it, unless it is there already.
set -euo pipefail
vllm_python=$1 vllm_model=$2 out=$3 rounds=${4:-2} concurrency=${5:-64}
mkdir -p "$out"
workload=$out/workload.jsonl
[ -s "$workload" ] || pagedllm bench throughput --dataset sharegpt --num-prompts 200 --seed 0 \
    --save-workload "$workload" --output-json "$out/warmup.json" >/dev/null
num=$(wc -l < "$workload")

source "$(dirname "$0")/wait_ready.sh"

run() {  # engine port command...
    local engine=$1 port=$2
    shift 2
    setsid "$@" > "$out/${engine}_server_$round.log" 2>&1 &
    local pid=$!
    wait_ready "http://127.0.0.1:$port" "$pid" || { echo "$engine did not start; see its log" >&2; exit 1; }
    local start load
    start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
    pagedllm bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$vllm_model" --dataset file \
        --dataset-path "$workload" --num-prompts "$num" --request-rate inf --max-concurrency "$concurrency" \
        --output-json "$out/${engine}_serve_$round.json" > "$out/${engine}_bench_$round.log" 2>&1
    kill -- -"$pid"; wait "$pid" 2>/dev/null || true
    python3 - "$out/${engine}_serve_$round.json" "$round" "$engine" "$start" "$load" >> "$out/summary_serve.tsv" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print("\t".join([*sys.argv[2:6], str(d["output_tokens_per_s"]), str(d["median_e2e_s"]), str(d["p99_e2e_s"])]))
EOF
    tail -1 "$out/summary_serve.tsv"
}

echo -e "round\tengine\tstart\tload\toutput_tokens_per_s\tp50_latency_s\tp99_latency_s" > "$out/summary_serve.tsv"
for round in $(seq 1 "$rounds"); do
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 run vllm-cpu 8001 "$vllm_python" -m \
        vllm.entrypoints.openai.api_server --model "$vllm_model" --host 127.0.0.1 --port 8001 --dtype "${VLLM_DTYPE:-bfloat16}" \
        --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --seed 0
    run pagedllm 8002 pagedllm serve --port 8002 --threads 2
done
