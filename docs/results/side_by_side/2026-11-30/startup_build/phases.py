"""Wall seconds of each phase of a default-model start (no profiler): wrappers around the runner's calls."""
import time

t0 = time.perf_counter()
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.model import model_runner as mr  # noqa: E402

marks = [("import", time.perf_counter() - t0)]


def timed(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            marks.append((label, time.perf_counter() - s))
    setattr(owner, name, wrapper)


timed(mr, "load_model", "load_model")
timed(mr, "model_class", "model_class")
timed(mr.dispatch, "tune", "dispatch.tune")
timed(mr.attention_dispatch, "tune", "attention tune")
timed(mr.heap, "trim_after_build", "trim")
timed(mr, "start_threads", "start_threads")
orig = mr.model_class
def mc(arch):
    cls = orig(arch)
    def build(*a, **k):
        s = time.perf_counter()
        m = cls(*a, **k)
        marks.append(("model build", time.perf_counter() - s))
        return m
    return build
mr.model_class = mc
s = time.perf_counter()
llm = LLM()
marks.append(("LLM()", time.perf_counter() - s))
s = time.perf_counter()
llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
marks.append(("generate", time.perf_counter() - s))
marks.append(("total", time.perf_counter() - t0))
print("  ".join(f"{k} {v:.2f}" for k, v in marks))
