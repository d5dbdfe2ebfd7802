cd /work/main/docs/results/side_by_side/2026-12-03/zen4/sampled_drafts
PY=/work/main/.venv/bin/python
for round in 1 2; do for k in 4 0; do uptime; $PY sampled_drafts.py edit_requests.jsonl $k 0.8 0.95 1 eos 2>&1 | grep tokens/s; done; done
