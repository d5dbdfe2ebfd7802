cd /work/main && . .venv/bin/activate
W=docs/results/side_by_side/2026-12-01/zen4/offline/workload.jsonl
O=/tmp/zen4/ab
date; uptime
# warm the old tree's kernel build and tables
PYTHONPATH=/tmp/wt_f9f PAGEDLLM_CACHE_DIR=/tmp/zen4/cache_f9f python -m pagedllm.entrypoints.cli bench throughput --dataset file --dataset-path $W --num-prompts 20 --threads 2 > $O/warm.log 2>&1
for r in 1 2; do
  echo -n "round $r vllm $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): "
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 /tmp/vllmcpu/bin/python /work/shared/peers/vllm_offline.py /tmp/smollm2-135m-instruct-hf $W 2>$O/vllm_$r.log | grep '^{' > $O/vllm_$r.json
  python3 -c "import json; print(round(json.load(open('$O/vllm_$r.json'))['output_tokens_per_s'],1))"
  echo -n "round $r head $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): "
  pagedllm bench throughput --dataset file --dataset-path $W --num-prompts 200 --threads 2 2>&1 | grep Throughput
  echo -n "round $r f9f03dc $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): "
  PYTHONPATH=/tmp/wt_f9f PAGEDLLM_CACHE_DIR=/tmp/zen4/cache_f9f python -m pagedllm.entrypoints.cli bench throughput --dataset file --dataset-path $W --num-prompts 200 --threads 2 2>&1 | grep Throughput
done
echo AB_DONE
