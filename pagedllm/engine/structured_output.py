"""Structured outputs: a request's StructuredOutputsParams compiled by llguidance against the model's vocabulary, and
one matcher per sequence that says, before each token, which tokens keep the output inside the grammar.

llguidance (Rust, no Python dependencies, vLLM's `guidance` backend) rather than xgrammar: xgrammar cannot be
installed without transformers and triton (~1.1 GB that a CPU engine never uses) and let raw control characters into
JSON strings in our tests; docs/structured-outputs.md has the measurements.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.engine.grammar_limits import (
    MASK_BUDGET_STEPS,
    MAX_CHOICES,
    MAX_MASK_MS_PER_STEP,
    check_lark,
    check_mask_cost,
    check_repeats,
    check_schema,
    check_size,
    load_schema_text,
)
from pagedllm.engine.grammar_worker import GrammarWorker
from pagedllm.errors import InvalidRequestError
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # imported where first used (0.01-0.03 s): engines without structured requests never need it
    import llguidance as llg

logger = logging.getLogger("pagedllm")

# JSON whitespace is bounded: llguidance's default (any run of whitespace wherever JSON allows it) lets a small model
# write newlines until max_tokens, which ends the output as invalid JSON.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"
GRAMMAR_CACHE_BYTES = 512 << 20  # what the cached compiled grammars may hold together, as the worker measures it
REFUSED_CACHE_SIZE = 1024  # grammars refused lately, kept so a client that repeats one costs no second trial

# Keywords whose value is a subschema, a list of subschemas, or a map of name -> subschema.
_SUBSCHEMA = ("items", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
              "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists properties and says nothing
    of extra keys, as vLLM and OpenAI's strict mode do: JSON schema allows any extra key by default, and a small
    model under the mask then invents keys. Walks subschemas only (never into const, enum or default values)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = [close_objects(s) for s in out[key]] if isinstance(out[key], list) else close_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_options(spec: StructuredOutputsParams) -> dict[str, Any]:
    """llguidance's JSON layout options for a request: bounded whitespace, or none at all."""
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": spec.whitespace_pattern or JSON_WHITESPACE}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The request's constraint as an llguidance grammar, within grammar_limits.py's bounds (not yet compiled: the
    worker and the matcher do that)."""
    import llguidance as llg

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            schema = load_schema_text(schema)
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("the JSON schema must be an object")
        check_schema(schema)
        for pattern in filter(None, [spec.whitespace_pattern]):
            check_size(pattern, "whitespace pattern")
            check_repeats(pattern, "the whitespace pattern")
        return llg.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=json_options(spec))
    if kind == "regex":
        check_size(spec.regex, "regex")
        check_repeats(spec.regex, "the regex")
        # \d is Unicode in Rust's regex (it matched '४'); regex_to_lark makes it [0-9] and escapes "/" for /.../.
        return llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(spec.regex, 'd')}/")
    if kind == "choice":
        if len(spec.choice) > MAX_CHOICES:
            raise InvalidRequestError(f"choice has {len(spec.choice):,} entries, over the limit of {MAX_CHOICES:,}")
        text = json.dumps(spec.choice, ensure_ascii=False)
        check_size(text, "choice list")
        return llg.grammar_from("choice", text)
    check_size(spec.grammar, "grammar")
    try:  # Lark (llguidance's dialect) as is, GBNF ("root ::= ...") converted to Lark
        lark = llg.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise InvalidRequestError(f"the grammar does not parse: {e}") from None
    check_lark(lark)
    return lark


@dataclass
class CompiledGrammar:
    """A grammar compiled against the vocabulary: a matcher in its start state that sequences copy."""

    grammar: str
    matcher: llg.LLMatcher
    compile_s: float
    bytes: int = 0  # what it holds (the worker's measure, plus its text): the cache's budget counts these
    mask_s: float = 0.0  # CPU seconds of one mask row in the start state, once its lexer states are built


class StructuredOutputManager:
    """Compiles grammars (cached by their text, thread-safe, so a server compiles off its event loop and off the
    engine's thread) and fills the token bitmask of the constrained rows of a step. A new grammar passes
    grammar_limits.py's checks, then a trial compile in a child process (grammar_worker.py), before llguidance
    compiles it here: what llguidance cannot survive never reaches this process."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_bytes: int = GRAMMAR_CACHE_BYTES, worker: bool = True) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which the bitmask covers
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = cache_bytes
        self.bitmask_words = (vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._refused: OrderedDict[bytes, str] = OrderedDict()  # sha256 of the key -> why it was refused
        self._lltokenizer: llg.LLTokenizer | None = None
        self._use_worker = worker
        self._worker: GrammarWorker | None = None
        self._filler: ThreadPoolExecutor | None = None  # the mask thread, started by the first fill

    @property
    def lltokenizer(self) -> llg.LLTokenizer:
        """The vocabulary as llguidance sees it, built on first use (~0.25 s for 49k tokens): engines that never
        get a structured request never pay for it."""
        import llguidance as llg

        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llg.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                    eos_token=self.eos_token_ids)
            return self._lltokenizer

    @property
    def worker(self) -> GrammarWorker:
        """The trial-compile child's handle (the child itself starts on the first new grammar)."""
        with self._lock:
            if self._worker is None:
                self._worker = GrammarWorker(self.tokenizer.backend.to_str(), self.vocab_size, self.eos_token_ids)
                weakref.finalize(self, self._worker.close)
            return self._worker

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache or compiled now (llguidance drops the GIL while it
        compiles); a grammar the limits, the trial or the compiler refuse raises InvalidRequestError."""
        key = spec.key()
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()  # refusals keep no big keys
        with self._lock:
            hit, refused = self._cache.get(key), self._refused.get(digest)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if refused is not None:
            raise InvalidRequestError(refused)
        try:
            compiled = self._compile_new(spec)
        except InvalidRequestError as e:
            self._remember_refusal(digest, str(e))
            raise
        self._add_to_cache(key, compiled)
        return compiled

    def _compile_new(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance as llg

        start = time.perf_counter()
        grammar = grammar_text(spec)
        trial = self.worker.trial(grammar) if self._use_worker else None
        matcher = llg.LLMatcher(self.lltokenizer, grammar, log_level=0)  # never raises: errors are a state
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the first lexer states now, not in a step
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {spec.kind} for structured outputs: {short_error(matcher.get_error())}")
        held = (trial.bytes if trial else 0) + len(grammar) + len(spec.key())  # the matcher, its text, its key
        return CompiledGrammar(grammar, matcher, time.perf_counter() - start, held, mask_seconds(matcher))

    def _add_to_cache(self, key: str, compiled: CompiledGrammar) -> None:
        """Least recently used out until the cached grammars hold at most cache_bytes (the newest always stays)."""
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._cached_bytes += compiled.bytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                self._cached_bytes -= self._cache.popitem(last=False)[1].bytes

    def _remember_refusal(self, digest: bytes, message: str) -> None:
        with self._lock:
            self._refused[digest] = message
            while len(self._refused) > REFUSED_CACHE_SIZE:
                self._refused.popitem(last=False)

    def new_matchers(self, spec: StructuredOutputsParams, n: int) -> list[llg.LLMatcher]:
        """One matcher per sample, each in the grammar's start state (a copy costs ~2 us); n samples whose masks
        would cost more than the mask budget from the start are refused now, not after a few steps."""
        compiled = self.compile(spec)
        check_mask_cost(compiled.mask_s, n)
        return [compiled.matcher.deep_copy() for _ in range(n)]

    def fill_bitmask(self, matchers: list[llg.LLMatcher], costs: list[float] | None = None,
                     drafts: list[list[int]] | None = None) -> torch.Tensor:
        """int32 [rows, ceil(V / 32)]: bit t % 32 of word t // 32 of a row is set when its matcher allows token t
        next; a row per matcher, then with `drafts` one more per proposed token (the mask after it). Row by row,
        without the GIL: llguidance's parallel executor took time from the model's threads after each fill (14x the
        involuntary context switches; docs/scripts/mask_costs.py). `costs` gets each matcher's first row's CPU
        seconds (this thread's, so a loaded machine does not inflate them): a draft's rows cost about as much, and
        the sequence's next proposals are capped so that all its rows fit the budget (MaskBudget.draft_room)."""
        drafts = drafts or [[] for _ in matchers]
        bitmask = torch.empty((len(matchers) + sum(map(len, drafts)), self.bitmask_words), dtype=torch.int32)
        row = 0
        for matcher, draft in zip(matchers, drafts, strict=True):
            start = time.thread_time()
            self._fill_row(matcher, bitmask, row)
            if costs is not None:
                costs.append(time.thread_time() - start)
            row = self._fill_draft_rows(matcher, draft, bitmask, row + 1)
        return bitmask

    def _fill_row(self, matcher: llg.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
        row_bytes = self.bitmask_words * 4
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    def _fill_draft_rows(self, matcher: llg.LLMatcher, draft: list[int], bitmask: torch.Tensor, row: int) -> int:
        """The masks after each proposed token the grammar allows, from `row` on; the matcher goes back to where it
        was. A row past a refused token repeats the last mask: the pick before it cannot be the refused token, so
        those rows are never kept. Returns the next free row. (An id past the vocabulary would put the matcher in
        error: checking stops before it.)"""
        known = next((i for i, t in enumerate(draft) if not 0 <= t < self.vocab_size), len(draft))
        allowed = matcher.validate_tokens(draft[:known]) if known else 0
        for token in draft[:allowed]:
            matcher.consume_token(token)
            self._fill_row(matcher, bitmask, row)
            row += 1
        if allowed:
            matcher.rollback(allowed)
        for _ in range(len(draft) - allowed):
            bitmask[row] = bitmask[row - 1]
            row += 1
        return row

    def start_fill(self, matchers: list[llg.LLMatcher], costs: list[float],
                   drafts: list[list[int]] | None = None) -> Future[torch.Tensor]:
        """fill_bitmask on the mask thread, so that the model's forward runs meanwhile; the matchers must not move
        (consume a token) until the future is done."""
        with self._lock:
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
                weakref.finalize(self, self._filler.shutdown, wait=False)
            filler = self._filler
        return filler.submit(self.fill_bitmask, matchers, costs, drafts)


def mask_seconds(matcher: llg.LLMatcher) -> float:
    """CPU seconds of one mask in the matcher's state (its lexer states built): the least of two, in this thread."""
    costs = []
    for _ in range(2):
        start = time.thread_time()
        matcher.compute_bitmask()
        costs.append(time.thread_time() - start)
    return min(costs)


def advance_grammar(matcher: llg.LLMatcher, token: int) -> bool:
    """Move a sequence's grammar past its new token; True when the grammar is complete (only EOS could follow).
    A token it refuses means the grammar could not be followed (the mask allowed nothing, or llguidance hit one of
    its limits, as `a{1000000}` does on its first token): that is an error for the request, never a finish."""
    if not matcher.consume_token(token):
        raise GrammarBrokenError(f"the output could not follow its grammar: {short_error(matcher.get_error())}")
    return matcher.is_stopped()


class GrammarBrokenError(RuntimeError):
    """A grammar that compiled could not be followed while generating."""


MAX_DRAFT_ROOM = 1 << 10  # no cap in practice: a step proposes at most --num-speculative-tokens


class MaskBudget:
    """What each request's grammar masks cost the steps, in CPU time (all its samples' rows), over its last `steps`
    steps: a request whose average is over the limit fails, so that one request's grammar cannot slow every step
    (the mask thread takes a core the model's threads would use)."""

    def __init__(self, limit_ms: float = MAX_MASK_MS_PER_STEP, steps: int = MASK_BUDGET_STEPS) -> None:
        self.limit_s = limit_ms / 1e3
        self.steps = steps
        self._recent: dict[str, deque[float]] = {}  # request id -> its last steps' mask seconds

    def draft_room(self, seconds: float) -> int:
        """Proposed tokens a request whose rows cost `seconds` together this step may add to each of its samples and
        keep its mask within the limit (a draft's rows are masked like its first: rows x cost <= limit)."""
        return max(0, int(self.limit_s / seconds) - 1) if seconds > 0 else MAX_DRAFT_ROOM

    def charge(self, costs: dict[str, float]) -> dict[str, GrammarBrokenError]:
        """Add one step's mask seconds per request; the requests now over the limit, with why."""
        over = {}
        for request_id, seconds in costs.items():
            recent = self._recent.setdefault(request_id, deque(maxlen=self.steps))
            recent.append(seconds)
            average = sum(recent) / len(recent)
            if len(recent) == self.steps and average > self.limit_s:
                over[request_id] = GrammarBrokenError(
                    f"the grammar's token mask cost {average * 1e3:.1f} ms of CPU per step (all samples, average "
                    f"of {self.steps} steps), over the limit of {self.limit_s * 1e3:g} ms: a simpler grammar or "
                    "fewer samples (n) fit")
        return over

    def __len__(self) -> int:
        return len(self._recent)

    def keep_only(self, request_ids: Collection[str]) -> None:
        """Forget the requests that have finished."""
        self._recent = {r: recent for r, recent in self._recent.items() if r in request_ids}


def short_error(message: str, limit: int = 300) -> str:
    """llguidance's errors can quote the whole grammar: a client gets the first line and the `error:` lines."""
    lines = [line.strip() for line in message.strip().splitlines()] or ["unknown error"]
    text = " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])
    return text if len(text) <= limit else text[:limit] + "..."
