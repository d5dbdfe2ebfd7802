"""Restore vs recompute of a long prefix with the KV tier (--kv-offload-dir), on the default model (SmolLM2-135M):
the time to first token of a PREFIX-token prompt plus a short new tail, when the prefix is computed (cold), restored
from the tier's files (the pool's cache emptied first: a prefix the pool evicted, or one from before a restart), and
found in the pool (a RAM prefix hit). Median of ROUNDS, each with a new tail; the tier's files are in the OS page
cache, as they are for a prefix saved minutes ago.
    python docs/scripts/kv_tier_restore.py [PREFIX] [ROUNDS]
"""

import random
import statistics
import sys
import tempfile
import time

from pagedllm import LLM, SamplingParams

PREFIX = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
TAIL = 16


def ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tier:
        llm = LLM(kv_cache_memory="512MiB", kv_offload_dir=tier)
        llm.engine.wait_for_kv_cache()
        times: dict[str, list[float]] = {"recompute": [], "tier restore": [], "RAM hit": []}
        restore_seconds = []
        for _ in range(ROUNDS):
            prefix = [rng.randrange(100, 49000) for _ in range(PREFIX)]
            tail = lambda: [rng.randrange(100, 49000) for _ in range(TAIL)]  # noqa: E731
            llm.engine.reset_prefix_cache()
            times["recompute"].append(ttft(llm, prefix + tail()))
            llm.engine.flush_kv_tier()  # the prefix's blocks on disk
            llm.engine.reset_prefix_cache()  # the pool forgets them: the next prompt finds them in the tier only
            before = llm.engine.stats().kv_tier
            times["tier restore"].append(ttft(llm, prefix + tail()))
            after = llm.engine.stats().kv_tier
            assert after["hits"] - before["hits"] == PREFIX // 16, "the prefix did not come back from the tier"
            restore_seconds.append(after["restore_seconds"] - before["restore_seconds"])
            times["RAM hit"].append(ttft(llm, prefix + tail()))
        base = statistics.median(times["recompute"])
        print(f"prefix {PREFIX} tokens + {TAIL} new, median of {ROUNDS} (time to first token):")
        for name, values in times.items():
            m = statistics.median(values)
            print(f"  {name:13s} {1000 * m:8.1f} ms  ({base / m:5.1f}x faster than recompute)")
        mib = llm.engine.stats().kv_tier["bytes_read"] / ROUNDS / 2**20
        print(f"  restore alone (read {mib:.0f} MiB, checked, copied into the pool): "
              f"{1000 * statistics.median(restore_seconds):.1f} ms")
        llm.engine.close()


if __name__ == "__main__":
    main()
