# A/B of two trees, alternated: /tmp/wt_base (a git worktree of the commit before) and /work/main (the change), each
# `pagedllm bench throughput` on the workload, the attention route it logs. usage: ab.sh WORKLOAD ROUNDS OUTDIR
W=$1; R=$2; O=$3; mkdir -p $O
N=$(wc -l < $W)
for r in $(seq 1 $R); do
  for tree in /tmp/wt_base /work/main; do
    name=$(basename $tree)
    out=$(cd /tmp && PYTHONPATH=$tree /work/main/.venv/bin/python -m pagedllm.entrypoints.cli --log-level INFO bench throughput --dataset file --dataset-path $W --num-prompts $N --threads 2 2>&1)
    echo "round $r $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg) $name: $(grep -o 'Throughput:.*' <<< "$out" | head -1)" | tee -a $O/ab.txt
    grep -o 'attention (.*' <<< "$out" | head -1 >> $O/ab.txt
  done
done
