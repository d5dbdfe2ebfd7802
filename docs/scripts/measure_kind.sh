#!/usr/bin/env bash
# What docs/performance.md keeps per CPU kind, in one folder, for a machine of a kind not measured before: the machine
# (`lscpu`, load), the kernel and attention tables (`pagedllm bench kernels`), pagedllm against vLLM's CPU build
# offline and through the servers at 64 clients (the 200 ShareGPT-like requests) and on long prompts (32 x 1,900
# tokens), the defaults against pagedllm's own flags, and where each run's time goes (`--breakdown`). Each part
# alternates ROUNDS times; run nothing else meanwhile (about 42 minutes at ROUNDS=2 on 2 vCPUs).
# usage: docs/scripts/measure_kind.sh VLLM_PYTHON VLLM_MODEL_DIR OUT_DIR [ROUNDS]
#   vLLM set up as docs/performance.md#reproduce says. WORKLOAD=FILE and LONG=FILE use those workloads instead of
#   writing them (the scripts' own: `--dataset sharegpt --num-prompts 200 --seed 0`; 1,900 random prompt tokens,
#   128 out, 32 requests, seed 0).
set -euo pipefail
vllm_python=$1 vllm_model=$2 out=$3 rounds=${4:-2}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/offline" "$out/serve" "$out/long" "$out/flags"
{ date -u; uptime; lscpu; } > "$out/machine.txt"
{ grep -o -w 'amx[a-z0-9_]*\|avx512_bf16\|avx512_vnni\|avx512f\|avx2' "$out/machine.txt" || true; } | sort -u \
    | tr '\n' ' ' | sed 's/^/ISA: /; s/$/\n/' | tee -a "$out/machine.txt"
pagedllm bench kernels --threads 2 > "$out/bench_kernels.txt" 2>&1

workload=$out/offline/workload.jsonl
[ -n "${WORKLOAD:-}" ] && cp "$WORKLOAD" "$workload"
"$here/side_by_side.sh" "$vllm_python" "$vllm_model" "$out/offline" "$rounds"
cp "$workload" "$out/serve/workload.jsonl"
"$here/side_by_side_serve.sh" "$vllm_python" "$vllm_model" "$out/serve" "$rounds" 64

long=$out/long/workload.jsonl
if [ -n "${LONG:-}" ]; then
    cp "$LONG" "$long"
else
    pagedllm bench throughput --input-len 1900 --output-len 128 --num-prompts 32 --seed 0 --threads 2 \
        --save-workload "$long" > /dev/null 2>&1
fi
"$here/side_by_side.sh" "$vllm_python" "$vllm_model" "$out/long" "$rounds"

"$here/flag_matrix.sh" "$workload" "$out/flags" "$rounds" 'defaults|-|' 'static|PAGEDLLM_KERNEL=static|' \
    'attention_static|PAGEDLLM_ATTENTION=static|' 'none|-|--quantization none' \
    'budget_1024|-|--max-num-batched-tokens 1024' 'budget_4096|-|--max-num-batched-tokens 4096'

# where each run's time goes on this kind (the step timers on: not a throughput figure)
mkdir -p "$out/breakdown"
for part in offline long; do
    requests=$(wc -l < "$out/$part/workload.jsonl")  # a file's requests, each once
    pagedllm bench throughput --dataset file --dataset-path "$out/$part/workload.jsonl" --num-prompts "$requests" \
        --threads 2 --breakdown --output-json "$out/breakdown/$part.json" > "$out/breakdown/$part.txt" 2>&1
done

for part in offline/summary.tsv serve/summary_serve.tsv long/summary.tsv flags/summary.tsv; do
    echo "== $part"
    cat "$out/$part"
done | tee "$out/summary.txt"
for part in offline long; do
    echo "== breakdown/$part.txt"
    grep -A1 "Where the time went" "$out/breakdown/$part.txt" || true
done | tee -a "$out/summary.txt"
