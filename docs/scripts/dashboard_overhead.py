"""What the dashboard costs the engine, measured without a browser: the CPU time of one snapshot (taken on the engine
thread) plus its publication (applied to the hub's pool and turned into JSON for a page), at N running requests,
against the CPU time of an engine step.

    python docs/scripts/dashboard_overhead.py --requests 64 --steps 200

Thread CPU time (time.thread_time) is used, so other load on the machine inflates both sides alike. The figure is
`rate * (snapshot + publish)` per second of engine time: the share of the engine's time the dashboard takes at
`--dashboard-rate` snapshots a second (it never takes more than one per step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.kv_trace import frame_of, to_json
from pagedllm.entrypoints.openai.dashboard import DashboardHub
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200, help="decode steps measured, each followed by a snapshot")
    parser.add_argument("--rate", type=float, default=4.0, help="snapshots per second (the server's default)")
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(args.requests):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 64, ignore_eos=True,
                                                           temperature=0))
    while engine.num_waiting or engine.num_generated_tokens < args.requests:
        engine.step()  # until every request has prefilled and sampled its first token
    hub = DashboardHub("bench", rate=args.rate)
    hub.subscribers.add(asyncio.Queue(maxsize=10**6))  # one page open: publish serialises every frame
    hub.publish(hub.take(engine))
    step_s, take_s, publish_s, sizes = [], [], [], []
    for _ in range(args.steps):
        t = time.thread_time()
        engine.step()
        step_s.append(time.thread_time() - t)
        t = time.thread_time()
        snap = hub.take(engine)
        take_s.append(time.thread_time() - t)
        t = time.thread_time()
        hub.publish(snap)
        publish_s.append(time.thread_time() - t)
        sizes.append(len(to_json(frame_of(snap))))
    t = time.thread_time()
    full = hub.full_frame()
    full_s = time.thread_time() - t
    c = engine.kv_snapshot().counters
    per_snapshot = statistics.mean(take_s) + statistics.mean(publish_s)
    result = {
        "running_requests": engine.num_running, "num_blocks": c.num_blocks, "blocks_in_use": c.blocks_in_use,
        "step_ms": round(1e3 * statistics.mean(step_s), 2),
        "snapshot_ms": round(1e3 * statistics.mean(take_s), 3),
        "publish_ms": round(1e3 * statistics.mean(publish_s), 3),
        "frame_bytes": round(statistics.mean(sizes)),
        "full_frame_ms": round(1e3 * full_s, 2), "full_frame_bytes": len(full),
        "share_of_engine_time_at_rate": round(args.rate * per_snapshot, 5),
        "share_if_every_step": round(per_snapshot / statistics.mean(step_s), 4),
        "rate": args.rate,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
