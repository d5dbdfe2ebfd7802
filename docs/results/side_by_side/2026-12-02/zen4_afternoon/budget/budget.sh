cd /work/main && . .venv/bin/activate
D=docs/results/side_by_side/2026-12-01/zen4
date; uptime
for r in 1 2; do for w in long offline; do for b in 1024 2048 4096; do
  if [ $w = long ]; then f=$D/long/workload.jsonl; n=32; else f=$D/offline/workload.jsonl; n=200; fi
  echo -n "round $r $w max-num-batched-tokens $b $(date +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): "
  pagedllm bench throughput --dataset file --dataset-path $f --num-prompts $n --threads 2 --max-num-batched-tokens $b 2>&1 | grep Throughput
done; done; done
echo BUDGET_DONE
