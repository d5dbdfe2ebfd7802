"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora_request import LoRARequest


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # who asked and how urgently (the request's SamplingParams.client / .priority): the per-client metrics' labels
    client: str | None = None
    priority: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    lora_request: LoRARequest | None = None  # the adapter it ran with (None: the base model)


@dataclass
class BeamSearchSequence:
    """One beam: prompt and generated tokens, and the sum of the generated tokens' logprobs."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finished: bool = False  # ended with EOS


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
