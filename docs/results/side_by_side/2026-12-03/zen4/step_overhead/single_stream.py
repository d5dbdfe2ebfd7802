"""One request at a time, greedy, 512 tokens (ignore_eos): output tokens/s of three runs in one engine.
Usage: python single_stream.py DRAFTS (0: prompt lookup off; 4: the default)."""
import sys
import time

from pagedllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(threads=2, num_speculative_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=512)
    llm.generate("Hello there, tell me a story", SamplingParams(max_tokens=8), use_tqdm=False)
    for _ in range(3):
        start = time.perf_counter()
        out = llm.generate("Hello there, tell me a story about a cat and a dog", params, use_tqdm=False)
        print(f"{len(out[0].outputs[0].token_ids) / (time.perf_counter() - start):.1f} tok/s", flush=True)
