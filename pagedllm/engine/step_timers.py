"""Timers around the parts of an engine step, for `pagedllm bench latency`: perf_counter wrappers installed for a
run and removed after, so the engine's hot path carries no timing code."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pagedllm.model import llama, model_runner
from pagedllm.model.tokenizer import IncrementalDetokenizer

# The parts of a decode step, in the order a step runs them; "other" is the step's wall time minus their sum.
PARTS = ("schedule", "prepare", "linear", "rotary", "kv_write", "attention", "norm", "activation", "forward_rest",
         "logits", "sampling", "detokenize", "output")
PART_HELP = {
    "schedule": "scheduler.schedule + commit, KV usage", "prepare": "model_runner.prepare (batch tensors)",
    "linear": "the decoder layers' matmuls (layers.linear)", "rotary": "model.rotary", "kv_write": "write_kv",
    "attention": "paged_attention", "norm": "add_rms_norm", "activation": "swiglu",
    "forward_rest": "the rest of model.forward (embedding, views, the layer loop)",
    "logits": "model.compute_logits / top_logits (lm_head)", "sampling": "SamplingBatch.build + sample",
    "detokenize": "incremental detokenizer", "output": "engine._process_token (minus detokenize), _output",
    "other": "step wall time minus every part above",
}


# ---- timers around a step ------------------------------------------------------------------------------------------
class _Delegate:
    """Stands in for a module or class: the given attributes replaced, every other one read from `target`."""

    def __init__(self, target: Any, **overrides: Any) -> None:
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class StepTimers:
    """perf_counter wrappers around what an engine step calls, installed on enter and removed on exit, so the
    engine's hot path carries no timing code. Times are exclusive: a timed call inside another counts only for
    itself (model.forward's part is what its timed calls leave), except inside model.compute_logits, which takes
    its lm_head matmul along (an opaque part)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(PARTS, 0)
        self._nested: list[float] = []  # per open timed call: seconds spent in timed calls inside it
        self._opaque = 0  # > 0 inside an opaque part: timed calls there just run
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> StepTimers:
        engine, model = self.engine, self.engine.runner.model
        for name, part in (("linear", "linear"), ("paged_attention", "attention"), ("write_kv", "kv_write"),
                           ("add_rms_norm", "norm"), ("swiglu", "activation")):
            self._wrap(llama, name, part)
        self._wrap(model, "forward", "forward_rest")
        self._wrap(model, "rotary", "rotary")
        self._wrap(model, "compute_logits", "logits", opaque=True)
        self._wrap(model, "top_logits", "logits", opaque=True)  # the greedy path's logits
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "commit", "schedule")
        self._wrap(engine.kv_usage, "record_step", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(model_runner, "sample", "sampling")
        batch_cls = model_runner.SamplingBatch
        self._set(model_runner, "SamplingBatch", _Delegate(batch_cls, build=self._timed("sampling", batch_cls.build)))
        self._wrap(IncrementalDetokenizer, "step", "detokenize")
        for name in ("_process_token", "_release_finished", "_output"):
            self._wrap(engine, name, "output")
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _UNSET:
                delattr(owner, name)  # the instance attribute goes; its class's method shows again
            else:
                setattr(owner, name, original)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name) if name in vars(owner) else _UNSET))
        setattr(owner, name, value)

    def _wrap(self, owner: Any, name: str, part: str, opaque: bool = False) -> None:
        self._set(owner, name, self._timed(part, getattr(owner, name), opaque))

    def _timed(self, part: str, fn: Callable, opaque: bool = False) -> Callable:
        perf_counter, nested = time.perf_counter, self._nested

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._opaque:
                return fn(*args, **kwargs)
            nested.append(0.0)
            self._opaque += opaque
            start = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = perf_counter() - start
                self._opaque -= opaque
                self.seconds[part] += elapsed - nested.pop()
                self.calls[part] += 1
                if nested:
                    nested[-1] += elapsed

        return timed


_UNSET = object()
