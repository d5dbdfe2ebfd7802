#!/bin/bash
# PYTHONPATH=REPO bash gate_runs.sh > gate_measured_routes.txt (REPO: the checkout; run from anywhere)
cd "$(dirname "$0")"
for i in 1 2 3; do python gate_auto.py 2>/dev/null | tail -1; done
echo "--- with one core busy"
python ../../../../../docs/scripts/cpu_noise.py 1.0 & np=$!
for i in 1 2 3; do python gate_auto.py 2>/dev/null | tail -1; done
kill $np
echo done
