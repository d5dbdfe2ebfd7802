#!/usr/bin/env bash
# pagedllm against vLLM's CPU build on the same requests, alternated: offline (all requests queued at once) and
# through each engine's OpenAI server at 64 concurrent clients. Install vLLM as ../shared/peers/README.md says.
# usage: docs/scripts/side_by_side.sh VLLM_PYTHON VLLM_MODEL_DIR OUT_DIR [ROUNDS] [MODES]
#   MODES: "offline server" (default) or either alone.  Prints one JSON line per run; results in OUT_DIR.
set -euo pipefail
VLLM_PY=$1 VLLM_MODEL=$2 OUT=$3 ROUNDS=${4:-2} MODES=${5:-offline server}
PEERS=$(cd "$(dirname "$0")/../../../shared/peers" && pwd)
mkdir -p "$OUT"
WORKLOAD=$OUT/workload.jsonl
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1
if [ ! -s "$WORKLOAD" ]; then  # the held-out ShareGPT-like workload: 200 requests, saved as token ids
  pagedllm bench throughput --dataset sharegpt --num-prompts 200 --seed 0 --save-workload "$WORKLOAD" \
    --output-json "$OUT/pagedllm_offline_0.json" > /dev/null
fi

wait_for() {  # URL: until it answers (a server's start-up, vLLM's includes its torch.compile)
  for _ in $(seq 600); do curl -sf "$1" > /dev/null && return 0; sleep 1; done; return 1
}

serve_bench() {  # NAME BASE_URL [--model NAME]: 64 clients on the saved workload through the OpenAI API
  local name=$1 url=$2; shift 2
  pagedllm bench serve --base-url "$url" "$@" --tokenizer "$VLLM_MODEL" --dataset file \
    --dataset-path "$WORKLOAD" --num-prompts 200 --max-concurrency 64 --metrics-interval 0 \
    --output-json "$OUT/$name.json" | tail -n 12
}

for round in $(seq "$ROUNDS"); do
  echo "# round $round, $(uptime)"
  if [[ " $MODES " == *" offline "* ]]; then
    "$VLLM_PY" "$PEERS/vllm_offline.py" "$VLLM_MODEL" "$WORKLOAD" 2> "$OUT/vllm_offline_$round.log" \
      | grep '"engine": "vllm-cpu"' | tee "$OUT/vllm_offline_$round.json"
    pagedllm bench throughput --dataset file --dataset-path "$WORKLOAD" --num-prompts 200 \
      --output-json "$OUT/pagedllm_offline_$round.json" 2> /dev/null | tail -n 1
  fi
  if [[ " $MODES " == *" server "* ]]; then
    "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL" --host 127.0.0.1 --port 8100 \
      --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --disable-log-requests > "$OUT/vllm_server.log" 2>&1 &
    pid=$!
    wait_for http://127.0.0.1:8100/v1/models
    serve_bench "vllm_server_$round" http://127.0.0.1:8100 --model "$VLLM_MODEL"
    kill "$pid"; wait "$pid" || true
    pagedllm serve --port 8101 > "$OUT/pagedllm_server.log" 2>&1 &
    pid=$!
    wait_for http://127.0.0.1:8101/health
    serve_bench "pagedllm_server_$round" http://127.0.0.1:8101
    kill "$pid"; wait "$pid" || true
  fi
done
