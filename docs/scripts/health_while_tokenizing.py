"""/health latency while the largest prompt the server would tokenize is being tokenized (issue 12's goal: < 50 ms).

Launches `pagedllm serve` (the default model, a 256 MiB KV cache), sends a prompt just under the cheap length bound
(max_model_len x the longest token's characters: 8192 x 81 for SmolLM2) a few times in a row, and polls /health every
20 ms meanwhile; prints the latencies of the polls that overlapped a tokenization. Usage:
    python docs/scripts/health_while_tokenizing.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time

import httpx
import numpy as np

from pagedllm.bench.server_process import ServerProcess


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hum about rivers and cities".split()
    log = tempfile.mktemp(suffix=".log")
    with ServerProcess(["--kv-cache-memory", "256MiB", "--disable-log-requests"], log) as server:
        max_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
        prompt = ""
        while len(prompt) < max_len * 81 - 100:
            prompt += rng.choice(words) + " "
        prompt = prompt[:max_len * 81 - 100]
        busy, lat, statuses, spans = [True], [], [], []

        def send() -> None:
            for _ in range(args.repeats):
                t0 = time.monotonic()
                r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=600)
                spans.append(time.monotonic() - t0)
                statuses.append(r.status_code)
            busy[0] = False

        thread = threading.Thread(target=send)
        thread.start()
        with httpx.Client() as http:
            while busy[0]:
                t0 = time.monotonic()
                assert http.get(f"{server.url}/health", timeout=60).status_code == 200
                lat.append(time.monotonic() - t0)
                time.sleep(0.02)
        thread.join()
    ms = np.array(lat) * 1000
    print(json.dumps({"prompt_chars": len(prompt), "max_model_len": max_len, "statuses": statuses,
                      "request_s": [round(s, 2) for s in spans], "health_polls": len(ms),
                      "health_ms_p50": round(float(np.percentile(ms, 50)), 1),
                      "health_ms_p99": round(float(np.percentile(ms, 99)), 1),
                      "health_ms_max": round(float(ms.max()), 1)}, indent=2))


if __name__ == "__main__":
    main()
