"""The parts of an engine step that `pagedllm bench latency` times: the engine, its model runner and its model each
run their parts under the timer `LLMEngine.step_timers()` hands them (model/timing.py), nothing replaced at run time."""

from __future__ import annotations

from pagedllm.model.timing import PartTimer

# The parts of a decode step, in the order a step runs them; "other" is the step's wall time minus their sum.
PARTS = ("schedule", "prepare", "linear", "rotary_kv", "attention", "norm", "activation", "forward_rest",
         "logits", "sampling", "detokenize", "output")
PART_HELP = {
    "schedule": "scheduler.schedule + commit, KV usage", "prepare": "model_runner.prepare (batch tensors)",
    "linear": "the decoder layers' matmuls (layers.linear)",
    "rotary_kv": "attention.rotate_and_store: q and k rotated, k and v into the cache",
    "attention": "StepAttention (paged attention)", "norm": "add_rms_norm", "activation": "swiglu",
    "forward_rest": "the rest of model.forward (embedding, views, the layer loop)",
    "logits": "model.compute_logits / top_logits (lm_head)",
    "sampling": "SamplingBatch.build + sample (or greedy's pick from the top logits)",
    "detokenize": "incremental detokenizer", "output": "the output processor (minus detokenize), RequestOutputs",
    "other": "step wall time minus every part above",
}


class StepTimers(PartTimer):
    """Seconds and calls per part of PARTS, summed over the steps run while the engine holds it."""

    def __init__(self) -> None:
        super().__init__(PARTS)
