#!/usr/bin/env bash
# Start-up to the first token, 3 rounds: a first start (an empty PAGEDLLM_CACHE_DIR: the dtype, kernel and attention
# tables measured) then a later one (read back). Run from outside the checkout with pagedllm installed.
set -euo pipefail
python=${PYTHON:-python}
date -u; uptime
for round in 1 2 3; do
    cache=$(mktemp -d)
    for which in "first start (empty cache folder)" "later start"; do
        t=$(cd /tmp && PAGEDLLM_CACHE_DIR=$cache "$python" -c "import time; t = time.time(); from pagedllm import LLM, SamplingParams; LLM(threads=2).generate('Hi', SamplingParams(max_tokens=1), use_tqdm=False); print(round(time.time() - t, 2))" 2>/dev/null | tail -1)
        echo "$which $round: $t"
    done
    rm -rf "$cache"
done
uptime
