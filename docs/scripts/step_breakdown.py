"""One decode step of BATCH sequences holding CTX tokens each, timed part by part with perf_counter wrappers.

For commits from d7865a1 (before issue 6, which has no `pagedllm bench latency`) up to ada2c4a, where the model
began to bind its parts at build time; on later ones it times only the logits, with drafts on: there, use
`pagedllm bench latency --batch-sizes 64 --context-lens 300 --num-speculative-tokens 0`, which times the same parts
through the engine's own timers. Two old commits side by side:
    python docs/scripts/step_breakdown.py 128 300 [none]    (none: --quantization none)
    git worktree add /tmp/before d7865a1 && PYTHONPATH=/tmp/before python docs/scripts/step_breakdown.py 128 300
(run from the repository root; the script's own folder is first on sys.path, so PYTHONPATH picks the engine).
"""

import functools
import random
import sys
import time
from collections import defaultdict

import torch.nn.functional as F

import pagedllm.model.llama as llama
import pagedllm.model.model_runner as model_runner
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

batch, ctx = int(sys.argv[1]), int(sys.argv[2])
extra = {"quantization": sys.argv[3]} if len(sys.argv) > 3 else {}  # e.g. none (commits before it lack the flag)
engine = LLMEngine(EngineConfig(kv_cache_memory="4GiB", max_num_seqs=batch, max_num_batched_tokens=max(1024, ctx),
                                **extra))
seconds: dict[str, float] = defaultdict(float)
in_logits = [0]  # the lm_head matmul inside compute_logits / top_logits counts as logits, not as linear


def wrap(owner, name: str, part: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if part == "linear" and in_logits[0]:
            return fn(*args, **kwargs)
        in_logits[0] += part == "logits"
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[part] += time.perf_counter() - start
            in_logits[0] -= part == "logits"

    setattr(owner, name, timed)


class TimedF:
    """torch.nn.functional with `linear` timed (d7865a1 calls F.linear; this commit calls layers.linear)."""

    def __getattr__(self, name):
        return getattr(F, name)

    def linear(self, *args, **kwargs):
        if in_logits[0]:
            return F.linear(*args, **kwargs)
        start = time.perf_counter()
        out = F.linear(*args, **kwargs)
        seconds["linear"] += time.perf_counter() - start
        return out


llama.F = TimedF()
model = engine.runner.model
for name, part in [("linear", "linear"), ("paged_attention", "attention"), ("write_kv", "kv write"),
                   ("add_rms_norm", "norm"), ("rms_norm", "norm"), ("swiglu", "act")]:
    if hasattr(llama, name):
        wrap(llama, name, part)
for name in ("compute_logits", "top_logits"):  # the lm_head matmul counts here, not as linear
    if hasattr(model, name):
        wrap(model, name, "logits")
wrap(model, "rotary", "rotary")
wrap(model_runner, "sample", "sample")
rng = random.Random(0)
for i in range(batch):
    prompt = [rng.randrange(1000, 40000) for _ in range(ctx)]
    engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
while any(not g.is_decoding for g in engine.scheduler.running) or engine.scheduler.waiting:
    engine.step()
for _ in range(2):
    engine.step()
if hasattr(engine, "wait_for_kv_cache"):
    engine.wait_for_kv_cache()  # the pool mapped, as a server's is: no page faults inside the timed steps
seconds.clear()
steps = 8
start = time.perf_counter()
for _ in range(steps):
    engine.step()
wall = (time.perf_counter() - start) / steps * 1e3
parts = {k: v / steps * 1e3 for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
print(f"batch {batch} ctx {ctx}: {wall:.1f} ms/step ({batch / wall * 1e3:.0f} tokens/s); "
      + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
