"""`pagedllm bench sessions`: local users who come back. Simulated chat users (every turn resends the whole
conversation plus a new message; the model's reply joins the history) and agent loops (a long system prompt with a
tool list, then steps that each add a tool result) talk to one server with think time between turns, with more
sessions than the KV pool holds. For each configuration it launches a server and reports time to first token of
first turns and of returning turns (p50 / p99), throughput and the server's prefix-cache hit rate:

  no-cache   prefix caching off: every turn recomputes its history
  ram        the prefix cache in the KV pool only (blocks evicted, least recently used first, when the pool is full)
  ram+tier   and a second tier on disk (--kv-offload-dir, a temporary directory): evicted blocks come back from it
  restart    the ram+tier server stopped, a new one started on the same tier directory, the returning turns replayed:
             its first turns are the first turn of a known session after a restart

A configuration the server cannot run (no --kv-offload-dir before the tier exists) is skipped with the reason.
--policies runs every configuration under each --scheduling-policy (fcfs, lpm: longest cached prefix first).
Prompts are synthetic words, seeded, sized with the model's tokenizer; replies are greedy, exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from pagedllm.bench.client import PREEMPTIONS, RequestResult, http_client, scrape_metrics, send_request
from pagedllm.bench.fairness import percentile
from pagedllm.bench.plots import pyplot
from pagedllm.bench.results import write_json
from pagedllm.bench.server_process import ServerProcess, engine_actions, fetch_model_card, passthrough_argv
from pagedllm.config import SCHEDULING_POLICIES, EngineConfig

CONFIGS = ("no-cache", "ram", "ram+tier", "restart")
SERVER_FLAGS = ["--disable-log-requests", "--uvicorn-log-level", "warning"]
TIER_FLAG = "--kv-offload-dir"
HITS, QUERIES = "pagedllm:prefix_cache_hits_total", "pagedllm:prefix_cache_queries_total"
TIER_PREFIX = "pagedllm:kv_tier"  # the second tier's counters, whatever they are named after it
TIER_HITS = "pagedllm:kv_tier_hits_total"  # blocks copied back from the tier
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education "
         "read write open close search fetch list create update delete file path query value count limit").split()


@dataclass
class Workload:
    chat_sessions: int = 8
    chat_turns: int = 4
    chat_first_len: int = 512  # tokens of a chat's first message (a pasted text), then chat_user_len per turn
    chat_user_len: int = 64
    agent_sessions: int = 2
    agent_steps: int = 4
    agent_system_len: int = 2048  # instructions and a tool list
    agent_tool_len: int = 128  # a tool result, each step after the first
    output_len: int = 32
    think_s: float = 2.0
    seed: int = 0


@dataclass
class Session:
    """One user's conversation: the system prompt (agents) and the user message of each turn."""

    name: str
    kind: str  # chat | agent
    system: str | None
    users: list[str]

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
        """The whole conversation up to the user message of `turn`, with the replies of the turns before it."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn + 1):
            out.append({"role": "user", "content": self.users[i]})
            if i < turn:
                out.append({"role": "assistant", "content": replies[i]})
        return out


def synthetic_text(tokenizer: Any, rng: random.Random, num_tokens: int) -> str:
    """Seeded words cut to `num_tokens` tokens of the model's tokenizer."""
    words = " ".join(rng.choice(WORDS) for _ in range(num_tokens + 8))
    return tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[:num_tokens])


def tool_list(tokenizer: Any, rng: random.Random, num_tokens: int) -> str:
    """An agent's system prompt: instructions, then tool definitions until it is `num_tokens` tokens long."""
    parts = ["You are an agent. Call one of the tools below, read its result, and continue until the task is done."]
    while len(tokenizer.encode("\n".join(parts), add_special_tokens=False)) < num_tokens:
        name = "_".join(rng.choice(WORDS) for _ in range(2))
        params = ", ".join(f'"{rng.choice(WORDS)}": "{rng.choice(["string", "integer", "boolean"])}"'
                           for _ in range(3))
        parts.append(f'{{"name": "{name}", "description": "{synthetic_text(tokenizer, rng, 24)}", '
                     f'"parameters": {{{params}}}}}')
    return tokenizer.decode(tokenizer.encode("\n".join(parts), add_special_tokens=False)[:num_tokens])


def make_sessions(tokenizer: Any, w: Workload) -> list[Session]:
    rng = random.Random(w.seed)
    sessions = [Session(f"chat{i}", "chat", None,
                        [synthetic_text(tokenizer, rng, w.chat_first_len if t == 0 else w.chat_user_len)
                         for t in range(w.chat_turns)]) for i in range(w.chat_sessions)]
    sessions += [Session(f"agent{i}", "agent", tool_list(tokenizer, rng, w.agent_system_len),
                         [synthetic_text(tokenizer, rng, w.chat_user_len if t == 0 else w.agent_tool_len)
                          for t in range(w.agent_steps)]) for i in range(w.agent_sessions)]
    return sessions


def final_tokens(tokenizer: Any, session: Session, w: Workload) -> int:
    """Tokens of the session's last prompt and reply (replies counted as output_len words of text)."""
    replies = [synthetic_text(tokenizer, random.Random(0), w.output_len)] * len(session.users)
    text = tokenizer.apply_chat_template(session.messages(len(session.users) - 1, replies))
    return len(tokenizer.encode(text, add_special_tokens=False)) + w.output_len


def pool_blocks(sizes: Sequence[int], fraction: float, block_size: int) -> int:
    """A KV pool holding `fraction` of all sessions' final histories, but at least two of the longest."""
    tokens = max(fraction * sum(sizes), 2 * max(sizes) + block_size)
    return math.ceil(tokens / block_size)


# ---- running sessions against a server ---------------------------------------------------------------------------
@dataclass
class Turn:
    session: str
    kind: str
    turn: int
    result: RequestResult


@dataclass
class Transcript:
    """What a live run sent: every turn's messages by session, for the restart to replay."""

    prompts: dict[str, list[list[dict[str, str]]]] = field(default_factory=dict)


async def run_session(http: aiohttp.ClientSession, model: str, session: Session, w: Workload, turns: Sequence[int],
                      start_s: float, t0: float, log: list[Turn], transcript: Transcript,
                      replay: Transcript | None) -> None:
    """The session's turns one after another, think time between them; live (replies from this server) or replayed
    (the messages a live run sent)."""
    await asyncio.sleep(start_s)
    replies: list[str] = []
    for i, turn in enumerate(turns):
        if i:
            await asyncio.sleep(w.think_s)
        messages = replay.prompts[session.name][turn] if replay else session.messages(turn, replies)
        transcript.prompts.setdefault(session.name, []).append(messages)
        body = {"model": model, "messages": messages, "max_tokens": w.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "user": session.name}
        log.append(Turn(session.name, session.kind, turn, RequestResult(0)))
        await send_request(http, body, log[-1].result, t0, path="v1/chat/completions")
        replies.append(log[-1].result.text)


async def run_sessions(base_url: str, model: str, sessions: Sequence[Session], w: Workload,
                       replay: Transcript | None) -> dict[str, Any]:
    """Every session at once (starts staggered over one think time); a replay skips each session's first turn."""
    log: list[Turn] = []
    transcript = Transcript()
    async with http_client(base_url, None) as http:
        before = await scrape_metrics(http) or {}
        t0 = time.perf_counter()
        await asyncio.gather(*(
            run_session(http, model, s, w, range(1 if replay else 0, len(s.users)), w.think_s * i / len(sessions),
                        t0, log, transcript, replay) for i, s in enumerate(sessions)))
        duration = time.perf_counter() - t0
        after = await scrape_metrics(http) or {}
    return {"log": log, "duration_s": duration, "before": before, "after": after, "transcript": transcript}


def summarize(config: str, policy: str, run: dict[str, Any], block_size: int) -> dict[str, Any]:
    """TTFT of each session's first turn in the run and of its returning turns; throughput; what the server counted
    (the prefix cache's hits count RAM blocks only; blocks restored from the second tier count apart)."""
    log, duration = run["log"], run["duration_s"]
    first = {t.session: min(u.turn for u in log if u.session == t.session) for t in log}
    ok = [t for t in log if t.result.error is None and t.result.ttft_s is not None]

    def ttfts(pred: Callable[[Turn], bool]) -> list[float]:
        return [t.result.ttft_s for t in ok if pred(t)]

    def returning(t: Turn) -> bool:
        return t.turn > first[t.session]

    delta = {k: run["after"].get(k, 0.0) - run["before"].get(k, 0.0) for k in run["after"]}
    output = sum(t.result.output_tokens for t in ok)
    prompt = sum(t.result.prompt_tokens or 0 for t in ok)
    restored = int(delta.get(TIER_HITS, 0)) * block_size
    return {
        "config": config, "policy": policy, "turns": len(log), "failed": len(log) - len(ok),
        "duration_s": round(duration, 2),
        "first_p50_ttft_s": percentile(ttfts(lambda t: not returning(t)), 50),
        "first_p99_ttft_s": percentile(ttfts(lambda t: not returning(t)), 99),
        "returning_p50_ttft_s": percentile(ttfts(returning), 50),
        "returning_p99_ttft_s": percentile(ttfts(returning), 99),
        "chat_returning_p50_ttft_s": percentile(ttfts(lambda t: returning(t) and t.kind == "chat"), 50),
        "agent_returning_p50_ttft_s": percentile(ttfts(lambda t: returning(t) and t.kind == "agent"), 50),
        "output_tokens_per_s": round(output / duration, 2) if duration else None,
        "prompt_tokens": prompt,
        "prefix_cache_queries": int(delta.get(QUERIES, 0)), "prefix_cache_hits": int(delta.get(HITS, 0)),
        "prefix_cache_hit_rate": round(delta[HITS] / delta[QUERIES], 4) if delta.get(QUERIES) else None,
        # prompt tokens the server computed (a preempted request's again; without a cache, that the server counts
        # nothing of, every prompt token once): the work the cache saved is the difference
        "restored_prompt_tokens": restored,
        "computed_prompt_tokens": int(delta[QUERIES] - delta.get(HITS, 0)) - restored if delta.get(QUERIES) else prompt,
        "preemptions": int(delta.get(PREEMPTIONS, 0)),
        "tier": {k: v for k, v in delta.items() if k.startswith(TIER_PREFIX) and k.endswith("_total")},
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "turn_log": [{"session": t.session, "kind": t.kind, "turn": t.turn, "start_s": round(t.result.start_s, 3),
                      "ttft_s": None if t.result.ttft_s is None else round(t.result.ttft_s, 4),
                      "latency_s": round(t.result.latency_s, 4), "prompt_tokens": t.result.prompt_tokens,
                      "output_tokens": t.result.output_tokens, "error": t.result.error} for t in log],
    }


# ---- configurations ----------------------------------------------------------------------------------------------
def serve_has_flag(flag: str) -> bool:
    """Whether this pagedllm's `serve` takes `flag` (the second tier's flags exist only once it is merged)."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--help"]
    help_text = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    return flag in help_text


def plan_runs(configs: Sequence[str], policies: Sequence[str], has_tier: bool) -> tuple[list[tuple[str, str]],
                                                                                         dict[str, str]]:
    """The (policy, config) runs in order and the skipped ones with the reason."""
    runs, skipped = [], {}
    for i, policy in enumerate(policies):
        for config in configs:
            key = f"{config}/{policy}"
            if config in ("ram+tier", "restart") and not has_tier:
                skipped[key] = f"this pagedllm serve has no {TIER_FLAG} (the second tier of issue 29 is not merged)"
            elif config == "restart" and "ram+tier" not in configs:
                skipped[key] = "restart replays the ram+tier run: add ram+tier to --configs"
            elif config == "no-cache" and i:
                skipped[key] = "without a prefix cache every policy orders alike: run under the first policy only"
            else:
                runs.append((policy, config))
    return runs, skipped


def config_flags(config: str, tier_dir: str) -> list[str]:
    if config == "no-cache":
        return ["--no-enable-prefix-caching"]
    return [TIER_FLAG, tier_dir] if config in ("ram+tier", "restart") else []


def run_all(runs: Sequence[tuple[str, str]], argv: list[str], sessions: list[Session], w: Workload, log_dir: str,
            tier_root: str, timeout: float, block_size: int) -> list[dict[str, Any]]:
    """One server per run; restart replays the transcript of the ram+tier run of its policy on that run's tier."""
    out, transcripts = [], {}
    for policy, config in runs:
        tier_dir = os.path.join(tier_root, policy)  # one per policy: lpm's tier run does not start on fcfs's blocks
        os.makedirs(tier_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"server-{config.replace('+', '-')}-{policy}.log")
        print(f"[{config}/{policy}] launching the server (log: {log_path})", file=sys.stderr)
        flags = [*argv, "--scheduling-policy", policy, *config_flags(config, tier_dir)]
        with ServerProcess(flags, log_path, timeout) as server:
            model = fetch_model_card(server.url)["id"]
            run = asyncio.run(run_sessions(server.url, model, sessions, w, transcripts.get(policy)
                                           if config == "restart" else None))
        if config == "ram+tier":
            transcripts[policy] = run["transcript"]
        out.append(summarize(config, policy, run, block_size))
        s = out[-1]
        print(f"[{config}/{policy}] TTFT p50 first {s['first_p50_ttft_s']} s, returning {s['returning_p50_ttft_s']}"
              f" s; hit rate {s['prefix_cache_hit_rate']}", file=sys.stderr)
    return out


def shown(value: object) -> str:
    return "-" if value is None else str(value)


def print_result(result: dict[str, Any]) -> None:
    print(f"{'config':<10}{'policy':<8}{'turns':>6}{'first p50/p99 s':>18}{'return p50/p99 s':>18}"
          f"{'chat/agent ret p50':>20}{'hit rate':>10}{'restored':>10}{'computed':>10}{'out tok/s':>11}")
    for r in result["runs"]:
        first = f"{shown(r['first_p50_ttft_s'])}/{shown(r['first_p99_ttft_s'])}"
        returning = f"{shown(r['returning_p50_ttft_s'])}/{shown(r['returning_p99_ttft_s'])}"
        kinds = f"{shown(r['chat_returning_p50_ttft_s'])}/{shown(r['agent_returning_p50_ttft_s'])}"
        print(f"{r['config']:<10}{r['policy']:<8}{r['turns'] - r['failed']:>6}{first:>18}{returning:>18}{kinds:>20}"
              f"{shown(r['prefix_cache_hit_rate']):>10}{shown(r.get('restored_prompt_tokens')):>10}"
              f"{shown(r['computed_prompt_tokens']):>10}"
              f"{shown(r['output_tokens_per_s']):>11}")
    for key, reason in result["skipped"].items():
        print(f"skipped {key}: {reason}")
    print("first: each session's first turn in the run (after a restart: its first replayed turn); hit rate: the RAM "
          "prefix cache's; restored: prompt tokens copied back from the second tier; computed: prompt tokens the "
          "server computed (a preempted request's again; no-cache: each once); "
          f"KV pool {result['num_blocks']} blocks")


def plot_result(result: dict[str, Any], path: str) -> None:
    """p50 TTFT of first and returning turns, one pair of bars per run."""
    plt = pyplot()
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(runs), 4))
    x = range(len(runs))
    for offset, key, label in ((-0.2, "first_p50_ttft_s", "first turn"), (0.2, "returning_p50_ttft_s", "returning")):
        ax.bar([i + offset for i in x], [r[key] or 0 for r in runs], width=0.4, label=label)
    ax.set_xticks(list(x), [f"{r['config']}\n{r['policy']}" for r in runs])
    ax.set_ylabel("p50 time to first token (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def split_list(value: str, allowed: Sequence[str], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or any(v not in allowed for v in items):
        raise ValueError(f"{flag} must name some of {', '.join(allowed)}, got {value!r}")
    return items


def cmd_sessions(args: argparse.Namespace, actions: Sequence[argparse.Action]) -> int:
    from pagedllm.model.loader import load_tokenizer

    configs = split_list(args.configs, CONFIGS, "--configs")
    policies = split_list(args.policies, SCHEDULING_POLICIES, "--policies")
    w = Workload(args.chat_sessions, args.chat_turns, args.chat_first_len, args.chat_user_len, args.agent_sessions,
                 args.agent_steps, args.agent_system_len, args.agent_tool_len, args.output_len, args.think_time,
                 args.seed)
    tokenizer = load_tokenizer(args.model)
    sessions = make_sessions(tokenizer, w)
    if not sessions:
        raise ValueError("no session to run: give --chat-sessions or --agent-sessions")
    sizes = [final_tokens(tokenizer, s, w) for s in sessions]
    num_blocks = args.num_blocks or pool_blocks(sizes, args.pool_fraction, args.block_size)
    skip = {"scheduling_policy", "enable_prefix_caching", "num_blocks", "kv_offload_dir"}
    argv = passthrough_argv(args, [a for a in actions if a.dest not in skip])
    argv += [*SERVER_FLAGS, "--num-blocks", str(num_blocks)]
    runs, skipped = plan_runs(configs, policies, serve_has_flag(TIER_FLAG))
    log_dir = args.server_log_dir or tempfile.mkdtemp(prefix="pagedllm-sessions-")
    os.makedirs(log_dir, exist_ok=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pagedllm-tier-") as tmp:
        try:
            results = run_all(runs, argv, sessions, w, log_dir, getattr(args, "kv_offload_dir", None) or tmp,
                              args.server_timeout, args.block_size)
        except RuntimeError as e:  # a server that would not start: its log says why
            print(f"error: {e}", file=sys.stderr)
            return 1
    result = {"workload": asdict(w), "session_tokens": dict(zip((s.name for s in sessions), sizes)),
              "num_blocks": num_blocks, "pool_tokens": num_blocks * args.block_size, "server_argv": argv,
              "skipped": skipped, "runs": results, "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cpu": cpu_name()}
    print_result(result)
    if args.output_json:
        write_json(args.output_json, result)
    if args.plot:
        plot_result(result, args.plot)
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sessions", help="chat users and agent loops who come back after thinking, more than the KV "
                                        "pool holds: time to first token of first and returning turns per cache "
                                        "configuration (no-cache, ram, ram+tier, restart)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--policies", default="fcfs", help="comma-separated scheduling policies, each runs every config")
    d = Workload()
    g = p.add_argument_group("workload")
    g.add_argument("--chat-sessions", type=int, default=d.chat_sessions)
    g.add_argument("--chat-turns", type=int, default=d.chat_turns)
    g.add_argument("--chat-first-len", type=int, default=d.chat_first_len, help="tokens of a chat's first message")
    g.add_argument("--chat-user-len", type=int, default=d.chat_user_len, help="tokens of each later user message "
                                                                              "(and an agent's task)")
    g.add_argument("--agent-sessions", type=int, default=d.agent_sessions)
    g.add_argument("--agent-steps", type=int, default=d.agent_steps)
    g.add_argument("--agent-system-len", type=int, default=d.agent_system_len,
                   help="tokens of an agent's system prompt (instructions and tools), one per agent session")
    g.add_argument("--agent-tool-len", type=int, default=d.agent_tool_len, help="tokens of a tool result")
    g.add_argument("--output-len", type=int, default=d.output_len, help="reply tokens of every turn")
    g.add_argument("--think-time", type=float, default=d.think_s, help="seconds between a reply and the next turn")
    g.add_argument("--pool-fraction", type=float, default=0.5,
                   help="without --num-blocks, a KV pool holding this share of all sessions' final histories")
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--server-log-dir", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of p50 TTFT, first and returning turns, per run")
    EngineConfig.add_cli_args(p)  # passed to every server (the bench sets the policy, caching and the tier); --seed
    p.set_defaults(func=functools.partial(cmd_sessions, actions=engine_actions()))
