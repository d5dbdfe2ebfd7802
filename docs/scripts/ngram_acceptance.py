"""What prompt-lookup (n-gram) speculation would save on a workload, before building it: the workload's greedy outputs
are generated once, then replayed against the engine's proposer (`core/ngram.py`: the latest earlier occurrence of the
last 3, else 2, else 1 tokens of prompt + output proposes the k tokens that followed it; greedy verification accepts
the longest matching prefix plus the model's own next token). Prints the decode steps a request would need against its
tokens, over the workload and for its longest requests, which set how many steps the run's tail lasts.

    python docs/scripts/ngram_acceptance.py WORKLOAD_JSONL [K ...]

WORKLOAD_JSONL as `pagedllm bench throughput --save-workload` writes it (greedy, ignore_eos, exact lengths, as the
benchmark runs it). The model and flags are the defaults; nothing here is timed.
"""

from __future__ import annotations

import json
import sys

from pagedllm import LLM, SamplingParams
from pagedllm.core.ngram import NgramIndex


def steps_needed(prompt: list[int], output: list[int], k: int) -> int:
    """Decode steps to produce `output` when each step verifies up to k tokens the engine's proposer offers."""
    context, lookup, done, steps = list(prompt), NgramIndex(), 0, 0
    while done < len(output):
        draft = lookup.propose(context, k)
        accepted = 0
        while accepted < len(draft) and done + accepted < len(output) and draft[accepted] == output[done + accepted]:
            accepted += 1
        taken = min(accepted + 1, len(output) - done)
        context += output[done:done + taken]
        done += taken
        steps += 1
    return steps


def main() -> None:
    path, ks = sys.argv[1], [int(k) for k in sys.argv[2:]] or [2, 4, 8]
    requests = [json.loads(line) for line in open(path)]
    llm = LLM()
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in requests]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    longest = sorted(range(len(requests)), key=lambda i: -len(outputs[i]))[:5]
    print(f"{len(requests)} requests, {sum(map(len, outputs))} output tokens; one token per step without speculation")
    for k in ks:
        steps = [steps_needed(r["prompt_token_ids"], out, k) for r, out in zip(requests, outputs)]
        tail = ", ".join(f"{len(outputs[i])} in {steps[i]}" for i in longest)
        print(f"k={k}: {sum(steps)} steps for {sum(map(len, outputs))} tokens "
              f"({sum(map(len, outputs)) / sum(steps):.2f} a step); the longest five: {tail}")


if __name__ == "__main__":
    main()
