# The same single request greedy (drafts on, the default), 9ca5e05 against /work/main, alternated four times.
cd /tmp
D=/work/main/docs/results/side_by_side/2026-12-03/zen4/sampling
PY=/work/main/.venv/bin/python
for round in 1 2 3 4; do
  for tree in /tmp/lm/old /work/main; do
    PYTHONPATH=$tree $PY $D/offline_sampled.py $D/single_request.jsonl 0.0 1.0 2>&1 | grep tokens/s
  done
done
uptime
