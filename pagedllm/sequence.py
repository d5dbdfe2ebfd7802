"""One request's sequence: its tokens, how many are in the KV cache, and its place in the request's life."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.outputs import Logprob, RequestMetrics
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request while the engine holds it. `num_computed_tokens` of `token_ids` have K/V in the cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    max_tokens: int  # params.max_tokens capped by what fits in max_model_len
    token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    output_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
