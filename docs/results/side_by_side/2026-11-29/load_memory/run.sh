#!/usr/bin/env bash
# Peak RSS of an engine's start and one request (load_rss.py), the tree before (a worktree of BASE) and this one,
# alternated, for each model given. usage: run.sh BASE_WORKTREE OUT MODEL...
set -u
base=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../../../../.." && pwd)
py=$repo/.venv/bin/python
mkdir -p "$out"
export PAGEDLLM_CACHE_DIR=$out/cache PYTHONSAFEPATH=1
cd /tmp
for model in "$@"; do
  for round in 1 2; do
    for side in before after; do
      tree=$repo; [ "$side" = before ] && tree=$base
      echo "== $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/') $side round $round $model" | tee -a "$out/log.txt"
      PYTHONPATH=$tree /usr/bin/time -f "exit %x, wall %e s, max RSS %M kB" "$py" "$here/load_rss.py" "$model" \
        2>&1 | grep -E "started in|exit|Killed|Error" | tee -a "$out/log.txt"
    done
  done
done
