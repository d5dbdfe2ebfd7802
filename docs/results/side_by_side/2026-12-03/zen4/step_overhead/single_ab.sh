#!/bin/bash
# single_stream.py on trees A and B, alternated three times, prompt lookup off and on. Usage: single_ab.sh A B
D=$(cd "$(dirname "$0")" && pwd)
cd /tmp
for round in 1 2 3; do for tree in $1 $2; do for k in 0 4; do
  echo "round $round $(basename $tree) drafts $k load $(cut -d' ' -f1 /proc/loadavg) $(date +%T): $(PYTHONPATH=$tree \
    /work/main/.venv/bin/python $D/single_stream.py $k 2>/dev/null | tr '\n' ' ')"
done; done; done
