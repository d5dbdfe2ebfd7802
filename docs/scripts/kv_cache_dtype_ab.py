"""What the KV cache's dtype gives a model run in fp32 (`--dtype auto` on CPUs without fast bf16): the 200-request
ShareGPT-like workload of `pagedllm bench throughput --dataset sharegpt --num-prompts 200 --seed 0` (greedy,
ignore_eos, exact output lengths), all queued at once, in one of three setups:

    python docs/scripts/kv_cache_dtype_ab.py fp32-cache   # kv_cache_dtype float32, 4 KiB pages (the old default)
    python docs/scripts/kv_cache_dtype_ab.py bf16-cache   # a bf16 cache, 4 KiB pages
    python docs/scripts/kv_cache_dtype_ab.py default      # a bf16 cache on transparent huge pages (the default)

Run them alternated, several times: the machine's speed moves between runs.
"""

from __future__ import annotations

import sys
import time

import pagedllm.model.prefault as prefault
from pagedllm.bench.datasets import sample_requests
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

MODES = ("fp32-cache", "bf16-cache", "default")


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "default"
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {', '.join(MODES)}")
    if mode != "default":
        prefault.advise_huge_pages = lambda caches: False  # the pool on 4 KiB pages, as before
    llm = LLM(None, threads=2, **({"kv_cache_dtype": "float32"} if mode == "fp32-cache" else {}))
    requests = sample_requests("sharegpt", llm.get_tokenizer(), 200, 0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    llm.engine.wait_for_kv_cache(timeout=120)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    runner = llm.engine.runner
    print(f"{mode}: {sum(r.output_len for r in requests) / wall:.1f} output tokens/s ({wall:.1f} s), "
          f"cache {runner.kv_dtype}, huge pages asked: {runner.prefault.huge_pages}")


if __name__ == "__main__":
    main()
