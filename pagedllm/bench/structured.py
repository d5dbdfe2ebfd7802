"""`pagedllm bench structured`: what structured outputs cost. A batch of JSON-schema requests against the same batch
unconstrained (same prompts, same number of tokens per request, so the batch shrinks the same way), run alternately,
per generated token; and the grammar compile time of a typical schema, cold and from the cache."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

from pagedllm.bench.results import write_json
from pagedllm.config import EngineConfig
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# A typical extraction schema: strings, a bounded integer, an enum, a nested object, an array.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "role": {"type": "string", "enum": ["engineer", "designer", "manager", "other"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "role", "address", "skills"],
}
FIRST_NAMES = ["Ada", "Linus", "Grace", "Alan", "Barbara", "Dennis", "Frances", "Ken", "Margaret", "Edsger", "Radia",
               "John", "Sophie", "Donald", "Hedy", "Tim"]


def prompts(tokenizer: Any, num: int) -> list[dict[str, Any]]:
    """Chat prompts asking for a JSON record of a different person each."""
    out = []
    for i in range(num):
        who = f"{FIRST_NAMES[i % len(FIRST_NAMES)]}, person number {i + 1}"
        text = tokenizer.apply_chat_template([{"role": "user", "content": (
            f"Write a JSON record for a fictional employee called {who}, with name, age, email, role, address "
            "(street, city, zip) and skills.")}])
        out.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return out


def compile_times(engine: Any, rounds: int) -> dict[str, float]:
    """Milliseconds to compile the schema: the engine's first grammar (which also builds llguidance's view of the
    vocabulary), a new schema (cold: its text changed, so the cache misses), the same one again (cached)."""
    def timed(spec: StructuredOutputsParams) -> float:
        start = time.perf_counter()
        engine.compile_grammar(spec)
        return (time.perf_counter() - start) * 1e3

    first = timed(StructuredOutputsParams(json={**SCHEMA, "title": "first"}))
    cold = [timed(StructuredOutputsParams(json={**SCHEMA, "title": f"cold-{i}"})) for i in range(rounds)]
    cached = [timed(StructuredOutputsParams(json={**SCHEMA, "title": "cold-0"})) for _ in range(rounds)]
    return {"first_ms": round(first, 2), "cold_ms": round(statistics.median(cold), 3),
            "cached_ms": round(statistics.median(cached), 4)}


def run_batch(llm: Any, batch: list[dict[str, Any]], params: list[SamplingParams]) -> tuple[float, list[int], int]:
    """Seconds, each request's output length, and how many outputs parse as JSON."""
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    parsed = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            parsed += 1
        except json.JSONDecodeError:
            pass
    return elapsed, [len(o.outputs[0].token_ids) for o in outs], parsed


def measure(llm: Any, batch: list[dict[str, Any]], temperature: float, max_tokens: int, rounds: int) -> dict:
    """Constrained and unconstrained runs alternately (the machine's other load hits both alike); tokens per second
    of each, their medians and the constrained run's relative cost per token."""
    spec = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, structured_outputs=spec)
                   for i in range(len(batch))]
    _, lengths, parsed = run_batch(llm, batch, constrained)  # warm-up, and the lengths the free runs copy
    free = [SamplingParams(temperature=temperature, max_tokens=n, seed=i, ignore_eos=True)
            for i, n in enumerate(lengths)]
    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    tokens = sum(lengths)
    for _ in range(rounds):
        for name, params in (("constrained", constrained), ("unconstrained", free)):
            # Seeded, so nearly the same tokens each time (bf16 / 4-bit numerics vary a little with the batch)
            elapsed, got, ok = run_batch(llm, batch, params)
            if name == "constrained":
                parsed = min(parsed, ok)
            runs[name].append(sum(got) / elapsed)
            print(f"  {name}: {sum(got)} tokens in {elapsed:.2f} s, {sum(got) / elapsed:.1f} tokens/s", flush=True)
    c, u = statistics.median(runs["constrained"]), statistics.median(runs["unconstrained"])
    return {"temperature": temperature, "requests": len(batch), "output_tokens": tokens,
            "mean_output_len": round(tokens / len(batch), 1), "parsed_json": parsed,
            "constrained_tokens_per_s": [round(x, 1) for x in runs["constrained"]],
            "unconstrained_tokens_per_s": [round(x, 1) for x in runs["unconstrained"]],
            "median_constrained_tokens_per_s": round(c, 1), "median_unconstrained_tokens_per_s": round(u, 1),
            "cost_per_token": round(u / c - 1, 4)}


def cmd_structured(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.bf16_choice import torch_dtype_name

    config = EngineConfig.from_cli_args(args)
    llm = LLM(**vars(config))
    load_before = os.getloadavg()
    result: dict[str, Any] = {"model": llm.engine.model_name, "dtype": torch_dtype_name(config),
                              "threads": config.num_threads, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                              "compile": compile_times(llm.engine, args.rounds * 3), "runs": []}
    c = result["compile"]
    print(f"Grammar compile (the schema of pagedllm.bench.structured): first {c['first_ms']:.1f} ms (builds the "
          f"vocabulary's index too), cold {c['cold_ms']:.2f} ms, cached {c['cached_ms']:.3f} ms")
    batch = prompts(llm.get_tokenizer(), args.num_prompts)
    for temperature in args.temperature:
        run = measure(llm, batch, temperature, args.max_tokens, args.rounds)
        result["runs"].append(run)
        print(f"temperature {temperature}: {run['requests']} requests, {run['output_tokens']} tokens "
              f"(mean {run['mean_output_len']}), {run['parsed_json']}/{run['requests']} parse as JSON | tokens/s "
              f"constrained {run['constrained_tokens_per_s']} vs unconstrained {run['unconstrained_tokens_per_s']}: "
              f"medians {run['median_constrained_tokens_per_s']} vs {run['median_unconstrained_tokens_per_s']}, "
              f"the mask costs {run['cost_per_token']:+.1%} per token")
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="structured outputs: a JSON-schema batch vs the same batch unconstrained, "
                       "and grammar compile times")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8],
                   help="one constrained/unconstrained comparison per temperature")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each kind per temperature")
    p.add_argument("--output-json", default=None)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_structured)
