cd /work/main && . .venv/bin/activate && W=/work/main/docs/results/side_by_side/2026-12-03/zen3/offline/workload.jsonl
uptime
docs/scripts/first_start_ab.sh $W 2 /work/main /tmp/wt/q8
uptime
