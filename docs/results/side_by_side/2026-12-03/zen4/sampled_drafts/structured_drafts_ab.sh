# JSON requests that quote their prompt, one after another (structured_drafts.py), drafts 4 against 0, alternated
# twice, greedy then sampled, on the checkout at /work/main.
cd /work/main/docs/results/side_by_side/2026-12-03/zen4/sampled_drafts
PY=/work/main/.venv/bin/python
for temperature in 0 0.8; do
  for round in 1 2; do
    for k in 4 0; do uptime; $PY structured_drafts.py $k $temperature 2>&1 | grep tokens/s; done
  done
done
uptime
