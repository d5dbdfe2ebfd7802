"""Sampling parameters of one request, named and defaulted as in vLLM."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InvalidRequestError

SEED_RANGE = (-(2**63), 2**63 - 1)  # torch.Generator.manual_seed takes [-2**63, 2**64); sample i draws seed + i
MAX_CLIENT_CHARS = 256  # a client name is a key the fair scheduler keeps a counter under


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar, as vLLM names it: exactly one of a JSON schema, any JSON object, a regex,
    a list of choices or a grammar (Lark in llguidance's dialect, or GBNF). The engine compiles it when the request
    arrives; one that does not compile is an InvalidRequestError."""

    json: dict | str | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object (response_format {"type": "json_object"})
    disable_any_whitespace: bool = False  # JSON: no whitespace at all between tokens ("," and ":" only)
    whitespace_pattern: str | None = None  # JSON: a regex for the whitespace between tokens

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError("structured outputs take exactly one of json, regex, choice, grammar, "
                                      f"json_object; got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("structured outputs: json must be a JSON schema (an object or its text)")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured outputs: choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"structured outputs: {name} must be a string")

    @property
    def kind(self) -> str:
        """Which of the constraints this is: json, regex, choice, grammar or json_object."""
        return next((k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None),
                    "json_object")

    def key(self) -> str:
        """The request's grammar as one canonical text: the compiled-grammar cache's key."""
        fields: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if self.kind in ("json", "json_object"):
            fields.update(ws=self.whitespace_pattern, compact=self.disable_any_whitespace)
        return _json.dumps(fields, sort_keys=True, ensure_ascii=False)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop; validated once, when the request arrives."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs to return per generated token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a grammar
    # Who waits: the scheduling hints ride with the sampling params so every engine client carries them unchanged.
    # priority: lower runs first (vLLM's convention), read under --scheduling-policy priority; client: who asked (the
    # API's `user` field), between whom --scheduling-policy fair shares the service (None: one anonymous client)
    priority: int = 0
    client: str | None = None

    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Reject values that make no sense before they reach the scheduler."""
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
             f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (disabled) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 10.0,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop_list), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
            (isinstance(self.priority, int) and not isinstance(self.priority, bool),
             f"priority must be an integer, got {self.priority!r}"),
            (self.client is None or (isinstance(self.client, str) and len(self.client) <= MAX_CLIENT_CHARS),
             f"client must be a string of at most {MAX_CLIENT_CHARS} characters"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class BeamSearchParams:
    """Beam search as vLLM's `LLM.beam_search`: keep the `beam_width` best continuations by length-penalised
    cumulative logprob."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= 10:  # candidates come from the top 2 * beam_width logprobs (at most 20)
            raise InvalidRequestError(f"beam_width must be in [1, 10], got {self.beam_width}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
