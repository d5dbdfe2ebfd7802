# Sourced by the servers' side-by-side scripts: serve_run NAME PORT COMMAND... starts one server alone (its log in
# $out), waits for /health, sends the workload with `pagedllm bench serve` (streamed, greedy, ignore_eos, exact
# lengths; at most $concurrency in flight, all arrived at once), stops it and appends a line to
# $out/summary_serve.tsv. Reads $out, $round, $workload, $num, $concurrency and $tokenizer; $BENCH_FLAGS adds flags
# to `pagedllm bench serve` (e.g. "--temperature 0.8 --top-p 0.95": every request sampled).
source "$(dirname "${BASH_SOURCE[0]}")/wait_ready.sh"

serve_run() {
    local name=$1 port=$2
    shift 2
    [ -s "$out/summary_serve.tsv" ] || echo -e \
        "round\tengine\tstart\tload\toutput_tokens_per_s\tp50_latency_s\tp99_latency_s\tfailed" > "$out/summary_serve.tsv"
    setsid "$@" > "$out/${name}_server_$round.log" 2>&1 &
    local pid=$!
    wait_ready "http://127.0.0.1:$port" "$pid" || { echo "$name did not start; see its log" >&2; exit 1; }
    local start load
    start=$(date +%H:%M:%S) load=$(cut -d' ' -f1 /proc/loadavg)
    local bench_extra
    read -r -a bench_extra <<< "${BENCH_FLAGS:-}"
    pagedllm bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$tokenizer" --dataset file \
        --dataset-path "$workload" --num-prompts "$num" --request-rate inf --max-concurrency "$concurrency" \
        "${bench_extra[@]}" --output-json "$out/${name}_serve_$round.json" > "$out/${name}_bench_$round.log" 2>&1
    kill -- -"$pid"; wait "$pid" 2>/dev/null || true
    python3 - "$out/${name}_serve_$round.json" "$round" "$name" "$start" "$load" >> "$out/summary_serve.tsv" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("\t".join([*sys.argv[2:6], str(d["output_tokens_per_s"]), str(d["median_e2e_s"]), str(d["p99_e2e_s"]),
                 str(d["num_failed"])]))
PY
    tail -1 "$out/summary_serve.tsv"
}
