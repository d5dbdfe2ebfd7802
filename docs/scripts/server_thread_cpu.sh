#!/usr/bin/env bash
# CPU seconds per thread of a pagedllm server over one `pagedllm bench serve` run, and the client's own CPU: where a
# server run's cores go (the engine thread, the event loop, the benchmark client beside them).
# usage: docs/scripts/server_thread_cpu.sh WORKLOAD_JSONL TOKENIZER_DIR [CONCURRENCY] [PORT]
#   WORKLOAD_JSONL  requests as `pagedllm bench throughput --save-workload` writes them
# Threads that start during the run (torch's OpenMP worker of the engine thread) are not in both snapshots and are
# not listed; a thread is listed when it used more than 0.1 s.
set -euo pipefail
workload=$1 tokenizer=$2 concurrency=${3:-64} port=${4:-8031}
pagedllm serve --port "$port" --threads 2 > /tmp/server_thread_cpu.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do kill -0 $pid; sleep 1; done
snapshot() {  # thread id, name, utime + stime in ticks
    for t in /proc/$pid/task/*; do echo "$(basename "$t") $(tr ' ' _ < "$t/comm") $(awk '{print $14 + $15}' "$t/stat")"; done | sort
}
before=$(snapshot)
start=$(date +%s.%N)
client=$( { /usr/bin/time -f "%U %S" pagedllm bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$tokenizer" \
    --dataset file --dataset-path "$workload" --num-prompts "$(wc -l < "$workload")" --request-rate inf \
    --max-concurrency "$concurrency" > /tmp/server_thread_cpu_client.log; } 2>&1 | tail -1)
wall=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {print b - a}')
join <(echo "$before") <(snapshot) | awk -v hz="$(getconf CLK_TCK)" \
    '{d = ($5 - $3) / hz; if (d > 0.1) printf "server thread %s (%s): %.1f s\n", $1, $2, d}'
echo "$client" | awk '{printf "client: %.1f s user + %.1f s system\n", $1, $2}'
printf "wall: %.1f s\n" "$wall"
grep -E "Output token throughput" /tmp/server_thread_cpu_client.log
