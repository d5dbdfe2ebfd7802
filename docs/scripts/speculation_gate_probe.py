"""Speculation's gate where drafts hold less often than in the benchmark: the workload's requests greedy but stopping
at end of text (no `ignore_eos`, whose repetition prompt lookup predicts well), each setting run in turn, ROUNDS times.
Prints per run the output tokens/s, the share of drafted tokens accepted and the gate's table (running range: the
median gain of drafts over its latest comparisons, and its choice).

    python docs/scripts/speculation_gate_probe.py WORKLOAD_JSONL ROUNDS [NAME=FLAGS ...]

WORKLOAD_JSONL as `pagedllm bench throughput --save-workload` writes it; each request's output length is its
max_tokens. Settings default to `gate=` (the defaults), `limit16=speculative_disable_by_batch_size:16` and
`off=num_speculative_tokens:0` (FLAGS: comma-separated LLM keyword:int pairs). Two threads, the default model.
"""

from __future__ import annotations

import json
import os
import sys
import time

from pagedllm import LLM, SamplingParams


def settings(args: list[str]) -> dict[str, dict[str, int]]:
    pairs = args or ["gate=", "limit16=speculative_disable_by_batch_size:16", "off=num_speculative_tokens:0"]
    out = {}
    for pair in pairs:
        name, _, flags = pair.partition("=")
        out[name] = {k: int(v) for k, v in (f.split(":") for f in flags.split(",") if f)}
    return out


def run(requests: list[dict], flags: dict[str, int]) -> str:
    llm = LLM(threads=2, **flags)
    llm.engine.wait_for_kv_cache()  # as the benchmark: the pool mapped before the clock starts
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"]) for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    accepted = stats.spec_accepted_tokens / stats.spec_draft_tokens if stats.spec_draft_tokens else 0.0
    gate = " ".join(f"{r['running']}:{r['drafts_gain']}{'+' if r['drafts'] else '-'}" for r in stats.spec_gate)
    llm.engine.close()
    return f"{tokens} tokens, {tokens / elapsed:.1f} tokens/s, accepted {accepted:.0%}, gate {gate or '(fixed)'}"


def main() -> None:
    path, rounds = sys.argv[1], int(sys.argv[2])
    requests = [json.loads(line) for line in open(path)]
    for round_ in range(1, rounds + 1):
        for name, flags in settings(sys.argv[3:]).items():
            load = os.getloadavg()[0]
            print(f"round {round_} {time.strftime('%H:%M:%S')} load {load:.2f} {name}: {run(requests, flags)}",
                  flush=True)


if __name__ == "__main__":
    main()
