# Through the OpenAI server: W's first 24 requests at what a client that sends no sampling fields gets (temperature 1.0,
# no top_p; streamed,
# ignore_eos, exact lengths), at 1 client, `pagedllm serve` with n-gram drafts (4, the default) against
# `--num-speculative-tokens 0`, a fresh server per run, alternated twice.
cd /work/main/docs/results/side_by_side/2026-12-03/zen4/sampled_drafts
PY=/work/main/.venv/bin/python
port=8034
for clients in 1; do
  for round in 1 2; do
    for k in 4 0; do
      setsid $PY -m pagedllm.entrypoints.cli serve --port $port --num-speculative-tokens $k > /tmp/serve_drafts.log 2>&1 &
      pid=$!
      until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do kill -0 $pid || exit 1; sleep 0.5; done
      load=$(cut -d' ' -f1 /proc/loadavg)
      figures=$($PY -m pagedllm.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port" --dataset file \
          --dataset-path w24.jsonl --num-prompts 24 --request-rate inf --max-concurrency $clients \
          --temperature 1.0 2>/dev/null \
          | awk '/Output token throughput/ {t = $NF} /Median E2E/ {m = $NF} /P99 E2E/ {p = $NF}
                 END {printf "%s tokens/s, p50 %.1f s, p99 %.1f s", t, m / 1000, p / 1000}')
      echo "clients $clients round $round $(date -u +%H:%M:%S) load $load drafts $k: $figures"
      kill -- -$pid; wait $pid 2>/dev/null
    done
  done
done
