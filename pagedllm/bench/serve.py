"""`pagedllm bench serve`: online serving against a running OpenAI-compatible server, the vLLM paper's section 6.2.

Requests arrive as a Poisson process and stream /v1/completions; per request the client times the first token, the
gaps between tokens and the whole request, and reports the paper's normalized latency (the mean over requests of
end-to-end latency / output tokens) beside the server's own /metrics figures. The workload flags and the workload
itself are shared with `pagedllm bench sweep` (sweep.py).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import platform
import random
import sys
from typing import Any

from pagedllm.bench.client import run_async, run_benchmark
from pagedllm.bench.plots import plot_timelines
from pagedllm.bench.results import write_json
from pagedllm.bench.sampling_flags import add_sampling_args, sampling_overrides
from pagedllm.bench.server_process import fetch_model_card
from pagedllm.bench.summary import print_summary, rate_json, summarize

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def add_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm bench serve`: a client for a running server (`pagedllm bench sweep`, in sweep.py, launches its own)."""
    sv = sub.add_parser("serve", help="online serving benchmark against a running OpenAI-compatible server")
    sv.add_argument("--base-url", default=DEFAULT_BASE_URL)
    sv.add_argument("--model", default=None, help="model name sent to the API, also the tokenizer's source if it "
                                                  "is a path (default: the server's first model)")
    sv.add_argument("--tokenizer", default=None, help="model folder or .gguf whose tokenizer makes the prompts "
                                                      "(default: --model, the server's model path, or the default)")
    sv.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"))
    sv.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival times")
    sv.add_argument("--request-rate", type=float, default=math.inf,
                    help="mean requests per second of the Poisson arrivals (inf: all at once)")
    sv.add_argument("--models", default=None, help="comma-separated model names (LoRA adapters, the base model's "
                                                   "name) the requests are spread over (default: --model for all)")
    sv.add_argument("--model-zipf", type=float, default=1.0,
                    help="with --models: name k is picked with weight 1 / (k + 1) ** EXPONENT (0: uniform)")
    add_workload_args(sv)
    add_sampling_args(sv)
    sv.add_argument("--output-json", default=None)
    sv.add_argument("--plot", default=None, help="PNG of KV cache usage and running requests over time")
    sv.set_defaults(func=cmd_serve)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random", help="a name of pagedllm.bench.datasets.DATASETS")
    g.add_argument("--dataset-path", default=None)
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--input-len", type=int, default=None)
    g.add_argument("--output-len", type=int, default=None)
    g.add_argument("--n", type=int, default=4, help="samples per request (parallel-sampling)")
    g.add_argument("--beam-width", type=int, default=4, help="beam-search: not served over the OpenAI API")
    g.add_argument("--prefix-len", type=int, default=200, help="shared-prefix: tokens of the shared prefix")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: any)")
    g.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics samples (0: none)")


def servable(requests: list[Any]) -> list[Any]:
    """The requests an OpenAI-compatible server can take: /v1/completions has no beam search, so those are
    skipped, with a message."""
    beams = [r for r in requests if r.beam_width > 0]
    if beams:
        print(f"skipping {len(beams)} beam-search requests: /v1/completions offers no beam search "
              "(run `pagedllm bench sharing` for beam search)", file=sys.stderr)
    kept = [r for r in requests if r.beam_width <= 0]
    if not kept:
        raise ValueError("no request left to send: every request of this workload needs beam search")
    return kept


def sample_workload(args: argparse.Namespace, tokenizer: Any, max_model_len: int | None, seed: int) -> list[Any]:
    from pagedllm.bench.datasets import sample_requests

    return servable(sample_requests(args.dataset, tokenizer, args.num_prompts, seed, dataset_path=args.dataset_path,
                                    input_len=args.input_len, output_len=args.output_len,
                                    max_model_len=max_model_len, n=args.n, beam_width=args.beam_width,
                                    prefix_len=args.prefix_len))


def tokenizer_source(explicit: str | None, model: str, card: dict[str, Any]) -> str | None:
    """Where the client's tokenizer comes from: --tokenizer, else the model name or the server's model path if
    either is a local path, else None (the default model)."""
    candidates = [explicit, model, card.get("root")]
    return next((c for c in candidates if c and os.path.exists(os.path.expanduser(c))), explicit)


def context(args: argparse.Namespace) -> dict[str, Any]:
    return {"dataset": args.dataset, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus"}


def request_models(names: str | None, count: int, exponent: float, seed: int) -> list[str] | None:
    """Each request's model name drawn from the comma-separated `names` by a Zipf law (the first the most often),
    seeded; None without names."""
    from pagedllm.bench.lora import zipf_picks

    if names is None:
        return None
    choices = [n.strip() for n in names.split(",") if n.strip()]
    if not choices:
        raise ValueError("--models names no model")
    return [choices[k] for k in zipf_picks(len(choices), count, exponent, random.Random(seed))]


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.bench.datasets import poisson_arrivals
    from pagedllm.model.loader import load_tokenizer

    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}")
    card = fetch_model_card(args.base_url, args.api_key)
    model = args.model or card["id"]
    source = tokenizer_source(args.tokenizer, model, card)
    print(f"model {model}; tokenizer of {source or 'the default model'}", file=sys.stderr)
    requests = sample_workload(args, load_tokenizer(source), card.get("max_model_len"), args.seed)
    models = request_models(args.models, len(requests), args.model_zipf, args.seed)
    run = run_async(run_benchmark(args.base_url, model, requests,
                                    poisson_arrivals(len(requests), args.request_rate, args.seed),
                                    max_concurrency=args.max_concurrency, api_key=args.api_key,
                                    sample_interval=args.metrics_interval, models=models,
                                    sampling=sampling_overrides(args)))
    summary = {"model": model, "base_url": args.base_url, **context(args), "sampling": sampling_overrides(args),
               **summarize(run, args.request_rate)}
    if models is not None:
        summary["requests_per_model"] = dict(collections.Counter(models))
    print_summary(summary)
    if args.output_json:
        write_json(args.output_json, summary)
    if args.plot:
        plot_timelines([(f"{args.dataset}, rate {rate_json(args.request_rate)} req/s", {"": run.timeline})],
                       args.plot)
    return 0
