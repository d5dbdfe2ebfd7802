#!/bin/bash
# Start-up to the first token (performance.md's command) and the default model's load, BEFORE and AFTER trees
# alternated, each in a fresh interpreter from a folder outside the checkouts (PYTHONPATH picks the tree).
# usage: startup_ab.sh PYTHON BEFORE_TREE AFTER_TREE ROUNDS OUT
set -u
py=$1; before=$2; after=$3; rounds=$4; out=$5
here=$(cd "$(dirname "$0")" && pwd)
cd /tmp
: > "$out"
for i in $(seq "$rounds"); do
  for side in before after; do
    tree=$before; [ $side = after ] && tree=$after
    load=$(cut -d' ' -f1 /proc/loadavg)
    first=$(PYTHONSAFEPATH=1 PYTHONPATH=$tree "$py" -c "import time; t = time.time(); from pagedllm import LLM, SamplingParams; LLM().generate('Hi', SamplingParams(max_tokens=1), use_tqdm=False); print(round(time.time() - t, 2))" 2>/dev/null | tail -1)
    loads=$(PYTHONSAFEPATH=1 PYTHONPATH=$tree "$py" "$here/load_probe.py" 2>/dev/null | tail -1)
    echo "$(date -u +%H:%M:%S) $side load $load: first token ${first} s; $loads" >> "$out"
  done
done
