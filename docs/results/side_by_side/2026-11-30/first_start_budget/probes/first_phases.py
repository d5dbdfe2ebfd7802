"""Wall seconds of each phase of a first start (empty cache folder) and of a later one: the build, the matmul table's
timing (kernel_timing.measure_paths), the bounded-shapes decision, the attention route, LLM() and the first token."""
import time

t0 = time.perf_counter()
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.model import dispatch, kernel_timing  # noqa: E402
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


timed(mr.ModelRunner, "build_model", "build")
timed(kernel_timing, "measure_paths", "matmul timing")
timed(dispatch, "measure_shapes", "shapes")
timed(mr.dispatch, "tune", "dispatch.tune")
timed(mr.attention_dispatch, "tune", "attention")
s = time.perf_counter()
llm = LLM()
marks.append(("LLM()", time.perf_counter() - s))
s = time.perf_counter()
llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
marks.append(("generate", time.perf_counter() - s))
marks.append(("first token", time.perf_counter() - t0))
print("  ".join(f"{k} {v:.2f}" for k, v in marks))
