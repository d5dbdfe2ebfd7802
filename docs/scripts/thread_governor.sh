#!/usr/bin/env bash
# A single stream (16-token prompt, 128 output tokens) while another process keeps part of one core busy (docs/scripts/cpu_noise.py):
# the default threads (a governor: one thread fewer per core others hold) against --threads 1 and --threads 2 fixed.
# WORKLOAD=FILE.jsonl runs that workload (its first 100 requests, bench throughput's default, all at once: a batch)
# instead of the single stream.
# usage: [WORKLOAD=FILE.jsonl] docs/scripts/thread_governor.sh OUT_DIR [ROUNDS]     (2 vCPUs; run with nothing else busy)
set -euo pipefail
out=${1:?out dir}; rounds=${2:-2}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
run() {  # noise threads label workload-args...
  local noise=$1 threads=$2 label=$3; shift 3
  local pid=""
  if [ "$noise" != 0 ]; then python "$here/cpu_noise.py" "$noise" & pid=$!; fi
  local targs=(); [ "$threads" != default ] && targs=(--threads "$threads")
  pagedllm bench throughput "$@" "${targs[@]}" --output-json "$out/$label.json" > "$out/$label.log" 2>&1 || true
  [ -n "$pid" ] && kill "$pid"
  python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], round(d.get('output_tokens_per_s', d.get('output_throughput', 0)), 1))" \
    "$out/$label.json" "$label" | tee -a "$out/summary.txt"
}
echo "start $(date -u +%H:%M:%S) $(uptime)" | tee -a "$out/summary.txt"
for r in $(seq "$rounds"); do
  for noise in 0 1.0 0.5; do
    for threads in default 1 2; do
      if [ -n "${WORKLOAD:-}" ]; then
        run "$noise" "$threads" "batch-noise$noise-threads$threads-r$r" --dataset file --dataset-path "$WORKLOAD"
      else
        run "$noise" "$threads" "single-noise$noise-threads$threads-r$r" --num-prompts 1 --input-len 16 --output-len 128
      fi
    done
  done
done
echo "end $(date -u +%H:%M:%S) $(uptime)" | tee -a "$out/summary.txt"
