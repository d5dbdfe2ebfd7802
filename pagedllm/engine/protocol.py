"""What a server uses of an engine: the `EngineClient` protocol (one engine in a thread, `AsyncLLMEngine`, or several
behind a router, `ReplicaPool`), the `RequestStream` a request's outputs arrive on, the errors a client or a stream
raises, and what the serving observers (metrics, the dashboard) read of the engine that steps (`SteppedEngine`).

The OpenAI server imports the engine through this module only, so a new backend is one class that implements
`EngineClient`. `check_admission` and `generate` are written here once for every client that subclasses it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.errors import InvalidRequestError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.core.kv_view import KVSnapshot
    from pagedllm.core.sequence import Sequence
    from pagedllm.core.service import ServiceLedger
    from pagedllm.engine.llm_engine import EngineCounters
    from pagedllm.engine.router import Router
    from pagedllm.engine.structured_output import CompiledGrammar
    from pagedllm.model.loader import ModelConfig
    from pagedllm.model.loader.peft import LoRAAdapter
    from pagedllm.model.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: no request can be served any more."""


class EngineRestartingError(RuntimeError):
    """The engine failed and is being replaced; the request should be retried."""


class RequestFailedError(RuntimeError):
    """A step failed on this request (and on no other): the server's fault, not the client's."""


class QueueFullError(RuntimeError):
    """Too many sequences are waiting; the caller should retry later."""


class TooManySequencesError(InvalidRequestError):
    """One request asks for more sequences (prompts x n) than may ever wait: retrying cannot help (a 400)."""


class RequestStream(Protocol):
    """One request's outputs (cumulative: each holds all tokens and text so far) as an async iterator; an error of
    the engine's is raised by the iteration. Cancelling it (or the task reading it) aborts the request."""

    request_id: str
    finished: bool

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput: ...

    def cancel(self) -> None:
        """Abort the request if it is still running (a no-op once it finished)."""

    def allow_restart(self) -> None:
        """The reader needs only the final output (nothing was streamed to a client), so a client may start the
        request over (a ReplicaPool does, on another replica, if this one dies)."""


class SteppedEngine(Protocol):
    """What the async layer and its observers read of the engine it steps (LLMEngine): requests in, one step at a
    time, outputs out, and the engine's state between steps."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    max_prompt_chars: int | None  # no text longer than this can fit (None: not known)
    model_config: ModelConfig  # the checkpoint's config (vocab_size)
    service: ServiceLedger  # what each client has been served (the dashboard's per-client table, --service-trace)

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int | None = None,
                    lora_request: LoRARequest | None = None) -> Sequence: ...

    def read_lora(self, lora_request: LoRARequest) -> LoRAAdapter: ...  # thread-safe: reads the adapter's files

    def add_read_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> None: ...

    def remove_lora(self, lora_int_id: int) -> bool: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def pop_failed_requests(self) -> dict[str, BaseException]: ...

    def stats(self) -> EngineCounters: ...

    def kv_snapshot(self, since: int | None = None) -> KVSnapshot: ...


class ServingObserver(Protocol):
    """Gets every batch of outputs from the async engine's loop thread (metrics, logging, the dashboard)."""

    def record(self, engine: SteppedEngine, outputs: list[RequestOutput]) -> None: ...

    def record_restart(self) -> None:
        """A fresh engine replaced a broken one (its counters start from zero, its requests are gone)."""


class EngineClient(Protocol):
    """An engine as the server sees it, used from the event loop. Facts (`tokenizer`, `max_model_len`, ...) never
    change while the client lives, so they are safe from worker threads too."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    max_prompt_chars: int | None  # a longer text is refused before it is tokenized (None: not known)
    max_waiting_requests: int  # admission: sequences (prompts x n) accepted but not running, at most

    def start(self) -> None:
        """Start serving; call from the event loop that will read the streams."""

    def shutdown(self) -> None: ...

    @property
    def is_alive(self) -> bool:
        """Serving now (/health's answer)."""

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running yet."""

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences (each request's n) accepted whose request has produced no output yet: what admission bounds."""

    def check_alive(self) -> None:
        """Raise EngineDeadError or EngineRestartingError unless serving."""

    def replica_health(self) -> list[dict[str, Any]] | None:
        """Per replica, its health and queues for /health's body; None for a single engine."""

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, checked against vocabulary and context (InvalidRequestError)."""

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output grammar before its request is queued, off the event loop; a grammar the
        compiler refuses raises InvalidRequestError."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request (on a LoRA adapter added by add_lora, or the base model); its outputs (or its error)
        arrive on the returned stream. Admission is the caller's `check_admission(num_seqs)`, once per request
        group."""

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and register an adapter off the event loop; one that cannot serve on this model raises
        InvalidRequestError (LoRALoadError) and changes nothing."""
        raise InvalidRequestError("LoRA adapters are not supported with --data-parallel-size")

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter that no request uses (InvalidRequestError if one does); False if it is unknown."""
        raise InvalidRequestError("LoRA adapters are not supported with --data-parallel-size")

    def abort(self, request_id: str) -> None: ...

    def check_admission(self, num_seqs: int = 1) -> None:
        """Raise before anything is queued if the engine is not serving, or if the `num_seqs` sequences a request
        adds (its prompts x n) would take the waiting ones past the bound: a request that alone exceeds it can never
        be admitted (TooManySequencesError, a 400), one that does not fit now may be retried (QueueFullError, a
        503). Counting sequences, not requests, keeps one batched request from queueing hundreds of times its share."""
        self.check_alive()
        bound = self.max_waiting_requests
        if num_seqs > bound:
            raise TooManySequencesError(
                f"this request asks for {num_seqs} sequences (prompts x n); at most {bound} may wait "
                "(--max-waiting-requests): send fewer prompts or a smaller n")
        waiting = self.num_waiting_seqs
        if waiting + num_seqs > bound:
            raise QueueFullError(f"{waiting} sequences are already waiting and this request adds {num_seqs} "
                                 f"(--max-waiting-requests {bound}); retry later")

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """vLLM's shape: an async generator of outputs; closing it early aborts the request."""
        self.check_admission(params.n)
        stream = self.add_request(request_id, prompt, params, lora_request) if lora_request is not None \
            else self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.cancel()


class ReplicaSetClient(EngineClient, Protocol):
    """An engine client over several replicas: their own metrics, and the router's counts, for /metrics; their KV
    snapshots for /dashboard."""

    router: Router

    def replica_metrics(self) -> list[tuple[int, str]]:
        """Each replica's Prometheus text, by replica index."""

    def watch_kv(self, listener: Callable[[int, KVSnapshot], None]) -> None:
        """Call `listener(replica, snapshot)` on the event loop with every KV snapshot (LLMEngine.kv_snapshot) that
        a replica takes on its engine thread: per replica, in order, a full one first (also after a restart), then
        diffs (for the dashboard)."""
