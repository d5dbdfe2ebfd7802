#!/bin/bash
# pagedllm offline (bench throughput, all 200 at once) then its server at 64 clients (bench serve), twice, on the
# ShareGPT-like workload of the Intel entries; OUT=DIR keeps the logs (default /tmp/ovs).
cd "$(dirname "$0")/../../../../.."
W=docs/results/side_by_side/2026-11-30/xeon_fp16/at_87a5b61/offline/workload.jsonl
out=${OUT:-/tmp/ovs}; mkdir -p $out
for round in 1 2; do
  echo "round $round offline start $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  pagedllm bench throughput --dataset file --dataset-path $W --num-prompts 200 --threads 2 --output-json $out/off_$round.json > $out/off_$round.log 2>&1
  grep -i 'output tok' $out/off_$round.log | tail -1
  pagedllm serve --port 8040 --threads 2 > $out/server_$round.log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8040/health >/dev/null; do sleep 0.5; done
  echo "round $round serve start $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  pagedllm bench serve --base-url http://127.0.0.1:8040 --dataset file --dataset-path $W --num-prompts 200 --request-rate inf --max-concurrency 64 --output-json $out/serve_$round.json > $out/serve_$round.log 2>&1
  grep -i 'Output token throughput\|Median E2E' $out/serve_$round.log
  kill $pid; wait $pid 2>/dev/null
done
echo done
