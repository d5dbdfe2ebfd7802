cd /tmp
W=/work/main/docs/results/side_by_side/2026-11-30/xeon_fp16/at_87a5b61/offline/workload.jsonl
S=/work/main/docs/results/side_by_side/2026-12-03/zen4/sampling/offline_sampled.py
PY=/work/main/.venv/bin/python
for round in 1 2; do  # old = 9ca5e05 (main before the kernels sampling)
  for tree in /tmp/lm/old /work/main; do
    uptime
    PYTHONPATH=$tree $PY $S $W 0.8 0.95 2>&1 | grep tokens/s
  done
done
uptime
PYTHONPATH=/work/main $PY $S $W 0.0 1.0 2>&1 | grep tokens/s
uptime
