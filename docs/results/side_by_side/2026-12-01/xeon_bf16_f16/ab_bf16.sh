#!/usr/bin/env bash
# bf16 models (--dtype bfloat16) at main (A) against the branch with int4_f16 in bf16 models (B), Intel Xeon model 207.
set -uo pipefail
OUT=/work/main/docs/results/side_by_side/2026-12-01/xeon_bf16_f16
W=/work/main/docs/results/side_by_side/2026-11-30/xeon_fp16/at_87a5b61/offline/workload.jsonl
export PATH=/work/main/.venv/bin:$PATH
declare -A TREE=([A]=/tmp/wt_main [B]=/tmp/wt_new)
for t in A B; do  # build, then the first start measures the kernel table
  (cd /tmp && PYTHONPATH=${TREE[$t]} PYTHONSAFEPATH=1 python -c "from pagedllm.model import kernels; kernels.load()")
  PYTHONPATH=${TREE[$t]} pagedllm bench kernels --dtype bfloat16 --threads 2 > $OUT/kernels_$t.txt 2>&1
done
echo -e "round\ttree\tstart\tload\toutput_tokens_per_s" > $OUT/throughput.tsv
for round in 1 2; do for t in A B; do
  start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
  PYTHONPATH=${TREE[$t]} pagedllm bench throughput --dataset file --dataset-path $W --num-prompts 200 --threads 2 \
     --dtype bfloat16 --output-json $OUT/tp_${t}_$round.json > $OUT/tp_${t}_$round.log 2>&1
  tps=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" $OUT/tp_${t}_$round.json)
  echo -e "$round\t$t\t$start\t$load\t$tps" >> $OUT/throughput.tsv
done; done
for round in 1 2; do for t in A B; do
  echo "== $t round $round $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/latency.txt
  PYTHONPATH=${TREE[$t]} pagedllm bench latency --batch-sizes 1,64,200 --context-lens 300 --steps 10 --threads 2 \
     --num-speculative-tokens 0 --dtype bfloat16 >> $OUT/latency.txt 2>&1
done; done
echo done >> $OUT/throughput.tsv
