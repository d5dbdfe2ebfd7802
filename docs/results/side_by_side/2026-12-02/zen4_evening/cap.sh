#!/bin/bash
# Where the server's gap to offline comes from on this kind: pagedllm offline (all 200 at once), offline held to 64
# sequences (--max-num-seqs 64, the clients' count), and the server at 64 clients, alternated twice on the Zen 4
# workload; OUT=DIR keeps the logs (default /tmp/cap).
cd "$(dirname "$0")/../../../../.."
W=docs/results/side_by_side/2026-12-01/zen4/offline/workload.jsonl
out=${OUT:-/tmp/cap}; mkdir -p $out
for round in 1 2; do
  for mode in all capped; do
    flag=""; [ $mode = capped ] && flag="--max-num-seqs 64"
    echo "round $round offline $mode start $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    pagedllm bench throughput --dataset file --dataset-path $W --num-prompts 200 --threads 2 $flag \
      --output-json $out/off_${mode}_$round.json > $out/off_${mode}_$round.log 2>&1
    grep -i 'output tok' $out/off_${mode}_$round.log | tail -1
  done
  pagedllm serve --port 8040 --threads 2 > $out/server_$round.log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8040/health >/dev/null; do sleep 0.5; done
  echo "round $round serve start $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  pagedllm bench serve --base-url http://127.0.0.1:8040 --dataset file --dataset-path $W --num-prompts 200 \
    --request-rate inf --max-concurrency 64 --output-json $out/serve_$round.json > $out/serve_$round.log 2>&1
  grep -i 'Output token throughput\|Median E2E' $out/serve_$round.log
  kill $pid; wait $pid 2>/dev/null
done
echo done
