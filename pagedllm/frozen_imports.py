"""The engine's heavy imports (torch's and ours: ~180k objects that live as long as the process; `from pagedllm
import LLM`, `pagedllm serve` and `pagedllm generate`) made with Python's cyclic collector held off, then frozen out of
its way (gc.freeze, as vLLM does after its start-up): on an AMD EPYC Zen 3 its passes over them while they were
imported took 0.41-0.43 s of a 2.4-3 s `from pagedllm import LLM`, and every later full pass walked them again. Frozen
objects are still freed by their reference counts; a cycle among them is not collected, so this runs once per module,
as it is first imported."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    """No collection while the block runs; what is alive at its end frozen; the collector as the caller had it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
