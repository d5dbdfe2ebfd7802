#!/usr/bin/env bash
# pagedllm's own flags on one workload, one run after another, alternated ROUNDS times: defaults against each
# variant (issue 27: "defaults within 3% of the best flags").
# usage: docs/scripts/flag_matrix.sh WORKLOAD OUT_DIR ROUNDS 'NAME|ENV...|FLAGS...' ...
#   each variant: a name, then environment assignments (or -), then extra `pagedllm bench throughput` flags, e.g.
#   'defaults|-|' 'w8a8|-|--quantization w8a8' 'cap1024|ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024|'
# Every run: --dataset file, all of the workload's requests, --threads 2; summary.tsv gets start, load, tokens/s and
# the process's peak RSS (GNU time).
set -euo pipefail
workload=$1 out=$2 rounds=$3
shift 3
mkdir -p "$out"
[ -s "$out/summary.tsv" ] || echo -e "round\tvariant\tstart\tload\toutput_tokens_per_s\tpeak_rss_mib" > "$out/summary.tsv"
for round in $(seq 1 "$rounds"); do
    for variant in "$@"; do
        IFS='|' read -r name envs flags <<< "$variant"
        [ "$envs" = "-" ] && envs=""
        start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
        # shellcheck disable=SC2086
        /usr/bin/time -o "$out/${name}_$round.rss" -f %M env $envs pagedllm bench throughput --dataset file --dataset-path "$workload" \
            --num-prompts "$(wc -l < "$workload")" --threads 2 --output-json "$out/${name}_$round.json" $flags \
            > "$out/${name}_$round.log" 2>&1
        tps=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" \
            "$out/${name}_$round.json")
        rss=$(( $(tail -1 "$out/${name}_$round.rss") / 1024 ))
        echo -e "$round\t$name\t$start\t$load\t$tps\t$rss" | tee -a "$out/summary.tsv"
    done
done
