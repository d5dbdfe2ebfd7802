#!/bin/bash
# A first start (empty cache folder: both tables measured) then a later one (the tables read), BEFORE and AFTER trees
# alternated, each phase timed by probes/first_phases.py from a folder outside the checkouts.
# usage: first_start_phases.sh PYTHON BEFORE_TREE AFTER_TREE ROUNDS OUT
set -u
py=$1; before=$2; after=$3; rounds=$4; out=$5
here=$(cd "$(dirname "$0")" && pwd)
cd /tmp
: > "$out"
for i in $(seq "$rounds"); do
  for side in before after; do
    tree=$before; [ $side = after ] && tree=$after
    cache=$(mktemp -d)
    for start in first later; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      line=$(PAGEDLLM_CACHE_DIR=$cache PYTHONSAFEPATH=1 PYTHONPATH=$tree "$py" "$here/probes/first_phases.py" 2>/dev/null | tail -1)
      echo "$(date -u +%H:%M:%S) $side $start load $load: $line" >> "$out"
    done
    rm -rf "$cache"
  done
done
