#!/usr/bin/env bash
# The default flags (fp32 arithmetic here), d794922 (A) against 0fc25f1 (B): the Int4Weight refactor leaves the default path as it was.
set -uo pipefail
OUT=/work/main/docs/results/side_by_side/2026-12-01/xeon_bf16_f16/defaults_ab
W=/work/main/docs/results/side_by_side/2026-11-30/xeon_fp16/at_87a5b61/offline/workload.jsonl
mkdir -p $OUT; cd /tmp
export PATH=/work/main/.venv/bin:$PATH
declare -A TREE=([A]=/tmp/wt_old [B]=/tmp/wt_new)
(PYTHONPATH=/tmp/wt_old PYTHONSAFEPATH=1 python -c "from pagedllm.model import kernels; kernels.load()")
echo -e "round\ttree\tstart\tload\toutput_tokens_per_s" > $OUT/throughput.tsv
for round in 1 2; do for t in A B; do
  start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
  PYTHONPATH=${TREE[$t]} pagedllm bench throughput --dataset file --dataset-path $W --num-prompts 200 --threads 2 \
     --output-json $OUT/tp_${t}_$round.json > $OUT/tp_${t}_$round.log 2>&1
  tps=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" $OUT/tp_${t}_$round.json)
  echo -e "$round\t$t\t$start\t$load\t$tps" >> $OUT/throughput.tsv
done; done
echo done >> $OUT/throughput.tsv
