#!/bin/bash
# The default single stream (drafts on), this checkout (new) against adfadc1 (old: OLD, a worktree of it),
# alternated four times; each side's kernel table cached by a first run before.
OLD=${OLD:-/tmp/lm/old}
cd /tmp
run() {
  PYTHONPATH=$1 /work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench throughput --num-prompts 1 --input-len 16 \
    --output-len 512 --threads 2 2>&1 | grep Throughput
}
run $OLD > /dev/null; run /work/main > /dev/null
for i in 1 2 3 4; do
  for side in old new; do
    src=/work/main; [ $side = old ] && src=$OLD
    echo "== $side $i $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')"
    run $src
  done
done
