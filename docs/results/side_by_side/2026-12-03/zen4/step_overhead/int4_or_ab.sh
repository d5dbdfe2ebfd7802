#!/bin/bash
# A/B of the int4 kernel: the L2-resident rows table (2 threads), then bench latency at batch 1 and 5 (no drafts).
A=$1; B=$2
D=$(cd "$(dirname "$0")" && pwd)
cd /tmp
PYTHONPATH=$A /work/main/.venv/bin/python -c "from pagedllm.model import kernels; kernels.load()"
PYTHONPATH=$B /work/main/.venv/bin/python -c "from pagedllm.model import kernels; kernels.load()"
for i in 1 2 3 4 5 6; do for t in $A $B; do
  echo "$t load $(cut -d' ' -f1 /proc/loadavg) $(date +%T): $(PYTHONPATH=$t /work/main/.venv/bin/python $D/int4_rows.py 2 | awk '{print $4, $5}' | tr '\n' ' ')"
done; done
for i in 1 2 3 4; do for t in $A $B; do
  echo "$t load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
  PYTHONPATH=$t /work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench latency --batch-sizes 1,5 \
      --context-lens 300 --steps 100 --threads 2 --num-speculative-tokens 0 2>&1 | grep '^| [0-9]'
done; done
