#!/usr/bin/env bash
# Two (or more) source trees of pagedllm through the OpenAI server, alternated: for each tree a fresh `pagedllm serve`
# (its PYTHONPATH set to the tree), and `pagedllm bench serve` from the same tree right after /health answers, on the
# same requests (streamed, greedy, ignore_eos, at most CONCURRENCY in flight). Prints output tokens/s and p50 / p99
# latency per run. A before/after of a change: one tree a `git worktree` of the old commit.
# usage: docs/scripts/serve_ab.sh WORKLOAD_JSONL ROUNDS CONCURRENCY PYTHONPATH...
#   A PYTHONPATH may list several directories (a:b); a directory whose uvloop/ and httptools/ packages raise
#   ImportError hides those two from uvicorn, which then runs asyncio's loop and h11 (the state before cdd396b).
#   DELAY=S waits S seconds after /health before the benchmark (default 0).
set -euo pipefail
export PYTHONSAFEPATH=1  # `python -m` run from a source tree would otherwise import that tree before PYTHONPATH's
workload=$1 rounds=$2 concurrency=$3
shift 3
python=${PYTHON:-python}
port=8031
for round in $(seq 1 "$rounds"); do
    for tree in "$@"; do
        PYTHONPATH=$tree setsid "$python" -m pagedllm.entrypoints.cli serve --port $port --threads 2 \
            > /tmp/serve_ab_server.log 2>&1 &
        pid=$!
        until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do kill -0 $pid; sleep 0.5; done
        sleep "${DELAY:-0}"
        figures=$(PYTHONPATH=$tree "$python" -m pagedllm.entrypoints.cli bench serve \
            --base-url "http://127.0.0.1:$port" --dataset file --dataset-path "$workload" \
            --num-prompts "$(wc -l < "$workload")" --request-rate inf --max-concurrency "$concurrency" 2>/dev/null \
            | awk '/Output token throughput/ {t = $NF} /Median E2E/ {m = $NF} /P99 E2E/ {p = $NF}
                   END {printf "%s tokens/s, p50 %.1f s, p99 %.1f s", t, m / 1000, p / 1000}')
        echo "round $round $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) $tree: $figures"
        kill -- -$pid
        wait $pid 2>/dev/null || true
    done
done
