"""pagedllm: an LLM inference and serving engine built on PagedAttention and continuous batching."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from pagedllm.frozen_imports import frozen_imports

__version__ = "0.1.0"

# Imported lazily, so that the memory-policy modules (scheduler, block manager) load without torch.
_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineConfig": "pagedllm.config",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "BeamSearchOutput": "pagedllm.outputs",
    "BeamSearchSequence": "pagedllm.outputs",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "LoRARequest": "pagedllm.lora_request",
    "serve_app": "pagedllm.entrypoints.serve_app",  # needs ray[serve]
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    module = _EXPORTS[name]
    if module not in sys.modules:
        with frozen_imports():  # torch's and the engine's objects: out of the collector's way
            importlib.import_module(module)
    return getattr(sys.modules[module], name)
