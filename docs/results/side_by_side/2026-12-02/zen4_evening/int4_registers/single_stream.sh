#!/bin/bash
# The default single stream (drafts on: verifications of up to 5 rows) on the commit before against this one,
# alternated four times, each with its own kernel table. Usage: single_stream.sh OLD_CHECKOUT NEW_CHECKOUT
old=$1; new=$2
for round in 1 2 3 4; do
  for side in old new; do
    dir=$old; [ $side = new ] && dir=$new
    echo "round $round $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$dir python -m pagedllm.entrypoints.cli bench throughput --num-prompts 1 --input-len 16 --output-len 512 \
      --threads 2 2>&1 | grep '^Throughput'
  done
done
