#!/usr/bin/env bash
# pagedllm's server alone with prompt lookup off (--num-speculative-tokens 0), the same requests and client as the
# side-by-side of the folder above: usage: run.sh OUT ROUNDS (OUT holds workload.jsonl)
set -euo pipefail
out=$1 rounds=${2:-2} concurrency=1
workload=$out/workload.jsonl num=$(wc -l < "$workload") tokenizer=/tmp/smollm2-135m-instruct-hf
source "$(dirname "$0")/../../../../../../scripts/serve_run.sh"
for round in $(seq 1 "$rounds"); do
    serve_run pagedllm 8002 pagedllm serve --port 8002 --threads 2 --num-speculative-tokens 0
done
