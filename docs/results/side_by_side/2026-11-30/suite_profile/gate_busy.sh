#!/bin/bash
# the accuracy gate's test beside one busy core, with a given environment
cd /work/main
( while :; do :; done ) & B=$!
start=$(date +%s.%N)
env "$@" PYTHONPATH=$PWD:$PWD/tests/engine:$PWD/tests/model .venv/bin/python -m pytest -q -p no:cacheprovider tests/model/test_real_model.py::test_default_path_passes_the_accuracy_gate > /tmp/probe/gate_$(echo "$@" | tr ' =' '__').txt 2>&1
end=$(date +%s.%N)
kill $B
echo "$@ : $(echo "$end - $start" | bc) s" >> /tmp/probe/gate_busy.txt
