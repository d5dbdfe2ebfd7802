#!/bin/bash
# the whole suite under -n 2: 8db6848 (worktree) then the working tree, one after the other
for side in "$@"; do
  tree=/work/wt/base; [ $side = main ] && tree=/work/main
  cd $tree
  n=$(ls /tmp/probe/pair_${side}_*.txt 2>/dev/null | wc -l)
  echo "$side start $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" > /tmp/probe/pair_${side}_$n.txt
  PYTHONPATH=$tree /usr/bin/time -v /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30 >> /tmp/probe/pair_${side}_$n.txt 2>&1
done
