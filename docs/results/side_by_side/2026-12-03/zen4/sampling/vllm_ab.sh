# vLLM's CPU build against pagedllm on workload W, every request sampled at temperature 0.8, top_p 0.95; alternated twice.
cd /tmp
W=/work/main/docs/results/side_by_side/2026-11-30/xeon_fp16/at_87a5b61/offline/workload.jsonl
D=/work/main/docs/results/side_by_side/2026-12-03/zen4/sampling
for round in 1 2; do
  uptime
  /tmp/vllmcpu/bin/python $D/vllm_sampled.py /tmp/smollm2-135m-instruct-hf $W 0.8 0.95 2>/dev/null | grep tokens/s
  uptime
  PYTHONPATH=/work/main /work/main/.venv/bin/python $D/offline_sampled.py $W 0.8 0.95 2>&1 | grep tokens/s
done
uptime
