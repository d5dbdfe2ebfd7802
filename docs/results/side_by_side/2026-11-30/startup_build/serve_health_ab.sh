#!/bin/bash
# `pagedllm serve --threads 2` to a 200 from /health, BEFORE and AFTER trees alternated (PYTHONPATH picks the tree),
# with the "KV cache mapped in" line each server logs.
# usage: serve_health_ab.sh PYTHON BEFORE_TREE AFTER_TREE ROUNDS OUT
set -u
py=$1; before=$2; after=$3; rounds=$4; out=$5
cd /tmp
: > "$out"
for i in $(seq "$rounds"); do
  for side in before after; do
    tree=$before; [ $side = after ] && tree=$after
    load=$(cut -d' ' -f1 /proc/loadavg)
    start=$(date +%s.%N)
    PYTHONSAFEPATH=1 PYTHONPATH=$tree "$py" -m pagedllm.entrypoints.cli serve --threads 2 --port 8931 > /tmp/serve_ab.log 2>&1 &
    pid=$!
    until curl -sf localhost:8931/health > /dev/null; do sleep 0.05; done
    ready=$(echo "$(date +%s.%N) - $start" | bc)
    kill $pid; wait $pid 2>/dev/null
    mapped=$(grep -o "KV cache mapped in [0-9.]* s" /tmp/serve_ab.log)
    echo "$(date -u +%H:%M:%S) $side load $load: /health after $(printf %.2f "$ready") s ($mapped)" >> "$out"
  done
done
