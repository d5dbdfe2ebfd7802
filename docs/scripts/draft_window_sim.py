"""Prompt lookup's proposals replayed on the workload's greedy outputs: how many tokens a sequence gets per step and
how many rows it costs, for a fixed number of proposed tokens against the window each sequence keeps (NgramIndex:
1 at first, doubled when a proposal is kept whole, else what was kept). Greedy outputs do not depend on
speculation, so one generate call without it gives every sequence's tokens, and each policy is replayed on them.

A step's time at a given batch is modelled as rows x (1 - f) + sequences x f, f being the share of a one-token
step's time that does not grow with its rows (attention over each context, the step's fixed costs): small batches
have f near 1 (reading the weights dominates), big ones 0.2-0.5 on the default model. The modelled gain over
steps without drafts is (tokens per step) / ((1 - f) x rows per step + f).

    python docs/scripts/draft_window_sim.py [NUM_PROMPTS]    # the 200 ShareGPT-like requests, seed 0
"""

from __future__ import annotations

import sys

from pagedllm.bench.datasets import sample_requests
from pagedllm.core.ngram import NgramIndex
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

SHARES = (0.2, 0.3, 0.5, 0.8)


def replay(prompt: list[int], output: list[int], k: int, windowed: bool) -> tuple[int, int, int, int, int, int]:
    """(tokens, rows, steps, proposals, proposals kept whole, proposals kept not at all) of one sequence's decode
    steps after its first token."""
    index = NgramIndex()
    tokens, i = list(prompt) + output[:1], 1
    made = rows = steps = proposals = whole = none = 0
    while i < len(output):
        room = min(k, index.window if windowed else k, len(output) - i - 1)
        draft = index.propose(tokens, room) if room > 0 else []
        kept = next((j for j, t in enumerate(draft) if t != output[i + j]), len(draft))
        index.record(len(draft), kept)
        tokens += output[i:i + kept + 1]
        i += kept + 1
        made, rows, steps = made + kept + 1, rows + 1 + len(draft), steps + 1
        if draft:
            proposals, whole, none = proposals + 1, whole + (kept == len(draft)), none + (kept == 0)
    return made, rows, steps, proposals, whole, none


def gain(tokens: float, rows: float, f: float) -> float:
    """Tokens per unit of time over steps without drafts (1 token, 1 row per sequence), as the docstring models it."""
    return tokens / ((1 - f) * rows + f)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    llm = LLM(None, threads=2, num_speculative_tokens=0)
    requests = sample_requests("sharegpt", llm.get_tokenizer(), n, 0)
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                        [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests],
                        use_tqdm=False)
    pairs = [(r.prompt_token_ids, list(o.outputs[0].token_ids)) for r, o in zip(requests, outs, strict=True)]
    print("| proposals | k | tokens / step | rows / step | rejected rows / step | "
          + " | ".join(f"gain at f={f}" for f in SHARES) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(SHARES))
    kept = []
    for windowed in (False, True):
        for k in (2, 4, 8):
            made, rows, steps, proposals, whole, none = (
                sum(x) for x in zip(*(replay(p, o, k, windowed) for p, o in pairs), strict=True))
            kept.append(f"{'window' if windowed else 'fixed'} {k}: {whole} of {proposals} proposals kept whole, "
                        f"{none} not at all")
            gains = [gain(made / steps, rows / steps, f) for f in SHARES]
            print(f"| {'window' if windowed else 'fixed'} | {k} | {made / steps:.2f} | {rows / steps:.2f} | "
                  f"{(rows - made) / steps:.2f} | " + " | ".join(f"{g:.2f}" for g in gains) + " |")
    print("\n".join(kept))


if __name__ == "__main__":
    main()
