#!/usr/bin/env bash
# One sequence, no server, alternated: llama.cpp's llama-bench (pp512: a 512-token prompt; tg512: 512 tokens decoded
# from an empty context) against pagedllm: `bench latency` for the 512-token prompt (its "prefill tok/s"), `bench
# throughput` for 512 tokens decoded after a 16-token prompt, speculation off (as llama.cpp's default) and on (the
# default here).
# usage: run.sh LLAMA_BENCH OUT ROUNDS GGUF...
set -euo pipefail
llama_bench=$1 out=$2 rounds=$3
shift 3
ours() {  # name, then bench throughput flags
    local name=$1
    shift
    echo "pagedllm $name $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): $(pagedllm bench throughput \
        --num-prompts 1 --input-len 16 --output-len 512 --threads 2 "$@" 2>&1 | grep '^Throughput')" | tee -a "$out/runs.txt"
}
for round in $(seq 1 "$rounds"); do
    echo "round $round llama.cpp $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/runs.txt"
    "$llama_bench" -m "$(IFS=,; echo "$*")" -t 2 -p 512 -n 512 -r 3 2>&1 | grep "|" | tee -a "$out/runs.txt"
    echo "round $round pagedllm $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/runs.txt"
    pagedllm bench latency --batch-sizes 1 --context-lens 512 --steps 8 --threads 2 --num-speculative-tokens 0 \
        2>&1 | grep "^|" | cut -d'|' -f2-6 | tee -a "$out/runs.txt"
    ours "decode, speculation off" --num-speculative-tokens 0
    ours "decode, defaults"
done
