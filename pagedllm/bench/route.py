"""`pagedllm bench route`: routing policies at scale, by simulation. A workload is replayed against 16-256 simulated
replicas that run the real router (engine/router.py) and each a real scheduler and block manager (the real prefix
cache, a pool of the given size); only the model is replaced, by step times from a cost model fitted to a
`pagedllm bench latency` run. Per policy and replica count: the engines' prefix hit rate, load imbalance (max / mean
queued tokens), simulated throughput, TTFT percentiles.

The simulated replicas "generate" each request's predetermined output tokens, so a chat's next turn, whose prompt
holds the previous answer, finds that answer in the cache of the replica that produced it, as in a real engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.bench.datasets import ALPACA, SHAREGPT, draw_lengths
from pagedllm.config import fixed_step_budget
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence as Seq
from pagedllm.core.sequence import SequenceGroup
from pagedllm.engine.router import ROUTING_POLICIES, Route, Router
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams

WORKLOADS = ("chats", "system-prompts", "sharegpt")
VOCAB = 49152
PARAMS = SamplingParams(temperature=0.0, ignore_eos=True)


# ---- the cost model -------------------------------------------------------------------------------------------------
@dataclass
class CostModel:
    """Milliseconds of one engine step: fixed + per batched token + per context token a decode reads + per
    (query, key) pair of a prompt chunk's attention. Fitted to `bench latency` rows (decode steps and prefills)."""

    fixed_ms: float
    token_ms: float
    decode_context_ms: float
    prefill_pair_ms: float
    source: str = "SmolLM2-135M, bf16, 2 threads (docs/results/latency_after.json)"

    def step_ms(self, plan: SchedulerOutput) -> float:
        tokens = decode_ctx = pairs = 0
        for s in plan.scheduled:
            tokens += s.num_new_tokens
            if s.num_new_tokens == 1:
                decode_ctx += s.end
            else:
                pairs += s.num_new_tokens * (s.start + s.num_new_tokens / 2)
        return (self.fixed_ms + self.token_ms * tokens + self.decode_context_ms * decode_ctx
                + self.prefill_pair_ms * pairs)

    @classmethod
    def fit(cls, latency: dict[str, Any], source: str) -> CostModel:
        """Least squares on relative error over every row's decode step and prefill."""
        rows, times = [], []
        for r in latency["rows"]:
            rows.append([1, r["batch"], r["batch"] * r["mean_context_len"], 0])
            times.append(r["step_ms"])
            n = r["batch"] * r["ctx"]
            rows.append([r["prefill_steps"], n, 0, r["batch"] * r["ctx"] ** 2 / 2])
            times.append(r["prefill_s"] * 1e3)
        a, y = np.asarray(rows, float), np.asarray(times, float)
        w = 1 / np.maximum(y, 1.0)
        coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
        return cls(*(max(0.0, float(c)) for c in coef), source=source)


# Fitted by CostModel.fit to docs/results/latency_after.json (this machine, 2 threads, bf16), rounded.
DEFAULT_COST = CostModel(19.3, 0.681, 1.63e-3, 3.98e-4)


# ---- workloads -------------------------------------------------------------------------------------------------------
@dataclass
class SimRequest:
    prompt: list[int]
    output: list[int]  # the tokens the simulated engine produces
    arrival: float = 0.0  # seconds; a chat's later turns arrive when the previous one ends plus a think time
    conversation: int = -1
    turn: int = 0


@dataclass
class Workload:
    name: str
    first: list[SimRequest]  # open-loop arrivals (a chat's first turns)
    follow_ups: dict[int, list[SimRequest]] = field(default_factory=dict)  # per conversation, its later turns
    think_time: float = 0.0

    @property
    def num_requests(self) -> int:
        return len(self.first) + sum(len(v) for v in self.follow_ups.values())


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, VOCAB) for _ in range(n)]


def arrivals(rng: np.random.Generator, num: int, rate: float) -> list[float]:
    return [0.0, *np.cumsum(rng.exponential(1.0 / rate, max(0, num - 1))).tolist()][:num]


def make_workload(name: str, num_requests: int, rate: float, seed: int, *, num_system_prompts: int,
                  system_len: int, turns: int, think_time: float, max_prompt_len: int) -> Workload:
    """`chats`: multi-turn conversations, each opening with one of a few system prompts, every turn's prompt the
    whole history; `system-prompts`: single requests, a system prompt (Zipf-popular) + a ShareGPT-like question;
    `sharegpt`: ShareGPT-like requests sharing nothing. Lengths from datasets.py's profiles."""
    rng, nprng = random.Random(seed), np.random.default_rng(seed)
    systems = [tokens(rng, system_len) for _ in range(num_system_prompts)]
    popularity = [1 / (k + 1) for k in range(num_system_prompts)]
    if name == "chats":
        conversations = max(1, num_requests // turns)
        users = draw_lengths(nprng, conversations * turns, ALPACA.input_mean * 2, ALPACA.input_sigma)
        answers = draw_lengths(nprng, conversations * turns, ALPACA.output_mean * 2, ALPACA.output_sigma)
        starts = arrivals(nprng, conversations, rate / turns)
        workload = Workload(name, [], think_time=think_time)
        for c in range(conversations):
            history = list(rng.choices(systems, popularity)[0])
            turns_of_c = []
            for t in range(turns):
                history += tokens(rng, users[c * turns + t])
                answer = tokens(rng, answers[c * turns + t])
                if len(history) + len(answer) > max_prompt_len:
                    break
                turns_of_c.append(SimRequest(list(history), answer, starts[c], c, t))
                history += answer
            workload.first.append(turns_of_c[0])
            workload.follow_ups[c] = turns_of_c[1:]
        return workload
    prompts = draw_lengths(nprng, num_requests, SHAREGPT.input_mean, SHAREGPT.input_sigma)
    outputs = draw_lengths(nprng, num_requests, SHAREGPT.output_mean, SHAREGPT.output_sigma)
    times = arrivals(nprng, num_requests, rate)
    first = []
    for i in range(num_requests):
        head = list(rng.choices(systems, popularity)[0]) if name == "system-prompts" else []
        prompt = (head + tokens(rng, prompts[i]))[:max_prompt_len // 2]
        first.append(SimRequest(prompt, tokens(rng, min(outputs[i], max_prompt_len // 2)), times[i]))
    return Workload(name, first)


# ---- the simulated replica ------------------------------------------------------------------------------------------
class SimReplica:
    """A real scheduler and block manager; a step's time from the cost model; outputs are the planned tokens."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.sched = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.plan: SchedulerOutput | None = None
        self.requests: dict[str, tuple[SimRequest, Route, float]] = {}  # id -> (request, route, arrival)
        self.busy_ms = 0.0

    def add(self, request_id: str, request: SimRequest, route: Route, now: float) -> None:
        seq = Seq(request_id, None, request.prompt, PARAMS, RequestMetrics(now), max_tokens=len(request.output))
        self.sched.add(SequenceGroup.make(seq))
        self.requests[request_id] = (request, route, now)

    def start_step(self, cost: CostModel) -> float | None:
        """Plan the next step; its duration in seconds (None: nothing to run)."""
        self.plan = self.sched.schedule()
        if self.plan.is_empty:
            self.plan = None
            return None
        ms = cost.step_ms(self.plan)
        self.busy_ms += ms
        return ms / 1e3

    def end_step(self) -> tuple[list[str], list[str]]:
        """Commit the step: (requests that got their first token, requests that finished)."""
        assert self.plan is not None
        plan, self.plan = self.plan, None
        self.sched.commit(plan)
        first, done = [], []
        for seq in plan.sampling_seqs:
            request = self.requests[seq.request_id][0]
            seq.append_token(request.output[seq.num_output_tokens], 0.0)
            if seq.num_output_tokens == 1:
                first.append(seq.request_id)
            if seq.num_output_tokens >= seq.max_tokens:
                seq.finish("length")
                group = next(g for g in self.sched.running if g.request_id == seq.request_id)
                self.sched.finish(group)
                done.append(seq.request_id)
        return first, done

    @property
    def queued_tokens(self) -> int:
        """Tokens still to compute: prompts not yet in the cache and outputs not yet generated."""
        return sum(s.num_uncomputed_tokens - (s.num_output_tokens > 0) + s.max_tokens - s.num_output_tokens
                   for g in [*self.sched.waiting, *self.sched.running] for s in g.seqs)


@dataclass
class SimResult:
    policy: str
    num_replicas: int
    workload: str
    num_requests: int
    prefix_hit_rate: float  # prompt tokens found in the engines' prefix caches / prompt tokens looked up
    router_affinity_hits: float  # share of requests the router sent to a replica predicted to hold their prefix
    imbalance: float  # mean over arrivals of max / mean queued tokens across replicas
    throughput_tok_s: float  # output tokens / (last finish - first arrival)
    busy_fraction: float  # replicas' step time / (replicas x makespan)
    ttft_p50_s: float
    ttft_p99_s: float
    preemptions: int
    wall_s: float


def simulate(workload: Workload, policy: str, num_replicas: int, cost: CostModel, *, num_blocks: int,
             block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, margin: int,
             seed: int) -> SimResult:
    """Replay the workload: events are arrivals and step ends, in time order."""
    started = time.perf_counter()
    router = Router(num_replicas, block_size, policy, margin, index_blocks=num_blocks, seed=seed)
    replicas = [SimReplica(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len)
                for _ in range(num_replicas)]
    think = np.random.default_rng(seed + 1)
    events: list[tuple[float, int, str, Any]] = []
    order = 0

    def push(at: float, kind: str, payload: Any) -> None:
        nonlocal order
        heapq.heappush(events, (at, order, kind, payload))
        order += 1

    for r in workload.first:
        push(r.arrival, "arrive", r)
    ttfts: list[float] = []
    imbalance: list[float] = []
    output_tokens, last_finish, ids = 0, 0.0, 0
    sample_every = max(1, workload.num_requests // 400)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            request: SimRequest = payload
            route = router.route(request.prompt, len(request.output))
            replica = replicas[route.replica]
            replica.add(f"r{ids}", request, route, now)
            ids += 1
            if replica.plan is None:
                push(now, "step", route.replica)  # an idle replica starts at once
            if ids % sample_every == 0:  # the load's spread, at a few hundred arrivals
                queued = [r.queued_tokens for r in replicas]
                if sum(queued):
                    imbalance.append(max(queued) / (sum(queued) / len(queued)))
        elif kind == "step":
            replica = replicas[payload]
            if replica.plan is not None:
                first, done = replica.end_step()
                for request_id in first:
                    ttfts.append(now - replica.requests[request_id][2])
                for request_id in done:
                    request, route, _ = replica.requests.pop(request_id)
                    router.finish(route)
                    output_tokens += len(request.output)
                    last_finish = now
                    follow = workload.follow_ups.get(request.conversation)
                    if follow and request.turn + 1 <= len(follow):
                        push(now + float(think.exponential(workload.think_time or 1e-9)), "arrive",
                             follow[request.turn])
            duration = replica.start_step(cost)
            if duration is not None:
                push(now + duration, "step", payload)
    first_arrival = min(r.arrival for r in workload.first)
    makespan = max(1e-9, last_finish - first_arrival)
    queries = sum(r.blocks.prefix_cache_queries for r in replicas)
    hits = sum(r.blocks.prefix_cache_hits for r in replicas)
    return SimResult(policy, num_replicas, workload.name, ids, round(hits / queries if queries else 0.0, 4),
                     round(router.affinity_hits / max(1, ids), 4), round(float(np.mean(imbalance)), 3),
                     round(output_tokens / makespan, 1),
                     round(sum(r.busy_ms for r in replicas) / 1e3 / (num_replicas * makespan), 3),
                     round(float(np.percentile(ttfts, 50)), 3), round(float(np.percentile(ttfts, 99)), 3),
                     sum(r.sched.num_preemptions for r in replicas), round(time.perf_counter() - started, 1))


# ---- command line ---------------------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive comma-separated integers, got {text!r}")
    return values


def cmd_route(args: argparse.Namespace) -> int:
    cost = DEFAULT_COST
    if args.latency_json:
        with open(args.latency_json) as f:
            cost = CostModel.fit(json.load(f), args.latency_json)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {p!r}; choose from {', '.join(ROUTING_POLICIES)}")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    results = []
    for name in workloads:
        for n in int_list(args.num_replicas):
            workload = make_workload(name, args.requests_per_replica * n, args.rate_per_replica * n, args.seed,
                                     num_system_prompts=args.num_system_prompts, system_len=args.system_len,
                                     turns=args.turns, think_time=args.think_time, max_prompt_len=args.max_model_len)
            for policy in policies:
                result = simulate(workload, policy, n, cost, num_blocks=args.num_blocks, block_size=args.block_size,
                                  max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=fixed_step_budget(args.max_num_batched_tokens),
                                  max_model_len=args.max_model_len, margin=args.routing_margin, seed=args.seed)
                results.append(dataclasses.asdict(result))
                print_row(results[-1], header=len(results) == 1)
    summary = {"cost_model": dataclasses.asdict(cost), "args": {k: v for k, v in vars(args).items() if k != "func"},
               "loadavg": [round(x, 2) for x in os.getloadavg()], "results": results}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        plot_route(summary, args.plot)
    return 0


COLUMNS = (("workload", "workload", "{}"), ("replicas", "num_replicas", "{}"), ("policy", "policy", "{}"),
           ("hit rate", "prefix_hit_rate", "{:.1%}"), ("imbalance", "imbalance", "{:.2f}"),
           ("tok/s", "throughput_tok_s", "{:.0f}"), ("busy", "busy_fraction", "{:.0%}"),
           ("TTFT p50 s", "ttft_p50_s", "{:.2f}"), ("TTFT p99 s", "ttft_p99_s", "{:.2f}"),
           ("preempt", "preemptions", "{}"), ("sim s", "wall_s", "{}"))


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print("| " + " | ".join(c[0] for c in COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    print("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |", flush=True)


def plot_route(summary: dict[str, Any], path: str) -> None:
    """Per workload (rows): prefix hit rate, throughput and p99 TTFT against the number of replicas, per policy."""
    from pagedllm.bench.plots import pyplot

    plt = pyplot()
    results = summary["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    policies = list(dict.fromkeys(r["policy"] for r in results))
    panels = (("prefix_hit_rate", "prefix hit rate"), ("throughput_per_replica", "output tokens/s per replica"),
              ("ttft_p99_s", "p99 TTFT (s)"), ("imbalance", "max/mean queued tokens"))
    fig, axes = plt.subplots(len(workloads), len(panels), figsize=(4 * len(panels), 3 * len(workloads)),
                             squeeze=False)
    for i, w in enumerate(workloads):
        for j, (key, label) in enumerate(panels):
            ax = axes[i][j]
            for p in policies:
                rows = sorted((r for r in results if r["workload"] == w and r["policy"] == p),
                              key=lambda r: r["num_replicas"])
                values = [r["throughput_tok_s"] / r["num_replicas"] if key == "throughput_per_replica" else r[key]
                          for r in rows]
                ax.plot([r["num_replicas"] for r in rows], values, marker="o", label=p)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{w}: {label}", fontsize=9)
            ax.set_xlabel("replicas")
            if key == "ttft_p99_s":
                ax.set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_command(sub: argparse._SubParsersAction) -> None:
    """`pagedllm bench route`: routing policies over many simulated replicas."""
    p = sub.add_parser("route", help="routing policies over 16-256 simulated replicas (real router, scheduler and "
                                     "prefix cache; step times from a cost model fitted to `bench latency`)")
    p.add_argument("--num-replicas", default="16,64,256", help="comma-separated replica counts")
    p.add_argument("--policies", default=",".join(ROUTING_POLICIES))
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--requests-per-replica", type=int, default=24)
    p.add_argument("--rate-per-replica", type=float, default=0.5, help="requests per second per replica (Poisson)")
    p.add_argument("--num-system-prompts", type=int, default=8, help="chats and system-prompts: distinct prefixes")
    p.add_argument("--system-len", type=int, default=768, help="tokens of each system prompt")
    p.add_argument("--turns", type=int, default=4, help="chats: turns per conversation")
    p.add_argument("--think-time", type=float, default=2.0, help="chats: mean seconds between an answer and the "
                                                                  "next turn")
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--routing-margin", type=int, default=8)
    p.add_argument("--latency-json", default=None, help="`pagedllm bench latency --output-json` file to fit the cost "
                                                        "model to (default: this machine's, 2 threads, bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: hit rate, throughput, p99 TTFT, imbalance vs replicas")
    p.set_defaults(func=cmd_route)
