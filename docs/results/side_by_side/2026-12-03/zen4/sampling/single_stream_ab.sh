# One request (W's first prompt cut to 16 tokens, 256 output tokens), sampled at temperature 0.8, top_p 0.95, then
# greedy; 9ca5e05 (before the kernels' sampling) against the checkout at /work/main, alternated three times.
cd /tmp
D=/work/main/docs/results/side_by_side/2026-12-03/zen4/sampling
PY=/work/main/.venv/bin/python
for round in 1 2 3; do
  for tree in /tmp/lm/old /work/main; do
    uptime
    PYTHONPATH=$tree $PY $D/offline_sampled.py $D/single_request.jsonl 0.8 0.95 2>&1 | grep tokens/s
  done
done
for tree in /tmp/lm/old /work/main; do
  PYTHONPATH=$tree $PY $D/offline_sampled.py $D/single_request.jsonl 0.0 1.0 2>&1 | grep tokens/s
done
uptime
