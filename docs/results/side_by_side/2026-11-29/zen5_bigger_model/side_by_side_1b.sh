#!/usr/bin/env bash
# vLLM's CPU build and pagedllm on a random model of Llama-3.2-1B's shapes (docs/scripts/random_llama.py), the same
# requests, alternated: vLLM on the Hugging Face folder (bf16), pagedllm on the Q4_1 GGUF with its defaults, then
# with n-gram speculation off (a random model's greedy text repeats otherwise than a trained one's).
# usage: side_by_side_1b.sh VLLM_PYTHON MODEL_DIR WORKLOAD OUT ROUNDS   (MODEL_DIR holds hf/ and model-Q4_1.gguf)
set -euo pipefail
vllm_python=$1 model=$2 workload=$3 out=$4 rounds=${5:-2}
repo=$(cd "$(dirname "$0")/../../../../.." && pwd)
mkdir -p "$out"
echo -e "round\tengine\tstart\tload\toutput_tokens_per_s" > "$out/summary.tsv"
row() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" "$1"; }
for round in $(seq 1 "$rounds"); do
    start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 "$vllm_python" "$repo/../shared/peers/vllm_offline.py" \
        "$model/hf" "$workload" 2>"$out/vllm_$round.log" | grep '^{' > "$out/vllm_$round.json"
    echo -e "$round\tvllm-cpu\t$start\t$load\t$(row "$out/vllm_$round.json")" | tee -a "$out/summary.tsv"
    for variant in defaults spec_off; do
        flags=(); [ $variant = spec_off ] && flags=(--num-speculative-tokens 0)
        start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
        pagedllm bench throughput --model "$model/model-Q4_1.gguf" --dataset file --dataset-path "$workload" \
            --num-prompts "$(wc -l < "$workload")" --threads 2 --output-json "$out/pagedllm_${variant}_$round.json" \
            "${flags[@]}" > "$out/pagedllm_${variant}_$round.log" 2>&1
        echo -e "$round\tpagedllm $variant\t$start\t$load\t$(row "$out/pagedllm_${variant}_$round.json")" \
            | tee -a "$out/summary.tsv"
    done
done
