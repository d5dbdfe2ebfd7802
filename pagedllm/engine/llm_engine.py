"""The engine: requests in, one scheduled model step at a time, outputs out."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.baselines import make_scheduler
from pagedllm.core.kv_stats import KVUsage
from pagedllm.core.kv_view import KVSnapshot, KVView
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.engine.faults import FaultInjector
from pagedllm.engine.step_timers import StepTimers
from pagedllm.engine.structured_output import CompiledGrammar, StructuredOutputManager, advance_grammar
from pagedllm.errors import InvalidRequestError
from pagedllm.model.loader import ModelConfig
from pagedllm.model.loader import load_tokenizer as load_tokenizer  # entrypoints load tokenizers through the engine
from pagedllm.model.model_runner import ModelRunner
from pagedllm.model.sampler import GrammarMask, SamplerOutput
from pagedllm.model.tokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm")
MAX_FAILED_STEPS_IN_A_ROW = 8  # steps in which nothing ran: the model fails whatever it runs


class EngineBrokenError(RuntimeError):
    """The engine cannot go on (its state is inconsistent, or the model fails on every request): replace it."""


@dataclass
class EngineCounters:
    """What the engine did with its KV blocks so far (prefix cache figures are in tokens)."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    blocks_in_use: int
    blocks_cached_free: int
    num_total_blocks: int
    cow_copies: int
    preemptions: int
    kv_slots_held: int  # last step: KV token slots in blocks held by running sequences (a shared block once)
    kv_tokens_stored: int  # last step: tokens stored in them
    kv_slots_held_sum: int  # summed over steps
    kv_tokens_stored_sum: int
    kv_steps: int  # steps summed
    peak_num_running: int  # most sequences running in one step
    spec_draft_tokens: int = 0  # speculative decoding: proposed tokens verified, and those accepted
    spec_accepted_tokens: int = 0

    @property
    def kv_waste_fraction(self) -> float:
        """Share of the held KV slots that stored nothing, over the run so far (tails of last blocks under paging,
        unused reservations under the reservation policies)."""
        return 1 - self.kv_tokens_stored_sum / self.kv_slots_held_sum if self.kv_slots_held_sum else 0.0

    @property
    def last_step_kv_waste_fraction(self) -> float:
        """The same share in the last step alone (the server's gauge)."""
        return 1 - self.kv_tokens_stored / self.kv_slots_held if self.kv_slots_held else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (cached-but-free blocks count as free)."""
        return self.blocks_in_use / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass
class StepRecord:
    """What one step did, for step observers: `blocks_in_use` is counted while the step's forward held them."""

    num_batched_tokens: int
    num_scheduled_seqs: int
    num_preempted: int
    blocks_in_use: int
    outputs: list[RequestOutput]


StepObserver = Callable[[StepRecord], None]


def tokenize_prompt(tokenizer: Any, prompt: str | list[int], vocab_size: int, max_model_len: int) -> list[int]:
    """LLMEngine.tokenize_prompt without an engine (a router tokenizes before it picks a replica)."""
    max_chars = max_model_len * tokenizer.max_token_chars
    if isinstance(prompt, str) and len(prompt) > max_chars:
        raise InvalidRequestError(f"the prompt has {len(prompt)} characters: more than max_model_len "
                                  f"({max_model_len}) tokens can hold")
    try:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate, which the tokenizer cannot take
        raise InvalidRequestError(f"the prompt is not valid text: {e}") from None
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(f"the prompt has {len(ids)} tokens, but max_model_len is {max_model_len} "
                                  "(it must leave room for at least one generated token)")
    return ids


class LLMEngine:
    """Owns the scheduler and the model runner; `step()` runs one iteration of continuous batching."""

    def __init__(self, config: EngineConfig, faults: FaultInjector | None = None) -> None:
        self.config = config
        self.faults = faults or FaultInjector.from_env()  # tests only
        self.runner, self.tokenizer, self.model_name = ModelRunner.from_config(config)
        self.model_config: ModelConfig = self.runner.model_config
        self.eos_token_ids = set(self.runner.eos_token_ids)
        self.max_model_len = self._max_model_len(self.runner.num_blocks)
        self.scheduler = make_scheduler(config.kv_policy, config.batching, self.runner.num_blocks, config.block_size,
                                        config.enable_prefix_caching, config.max_num_seqs,
                                        config.max_num_batched_tokens, self.max_model_len)
        self.block_manager = self.scheduler.block_manager
        if config.kv_policy == "paged" and config.batching == "continuous":  # the baselines reserve exact lengths
            self.scheduler.num_speculative_tokens = config.num_speculative_tokens
            self.scheduler.speculative_max_running = config.speculative_disable_by_batch_size
        self.num_draft_tokens = 0  # proposed tokens verified, and those accepted (vLLM's spec_decode counters)
        self.num_accepted_tokens = 0
        self.kv_usage = KVUsage()
        self.groups: dict[str, SequenceGroup] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}  # by seq_id
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.matchers: dict[int, Any] = {}  # by seq_id: the grammar state of structured-output sequences
        self.observers: list[StepObserver] = []
        self.failed: dict[str, BaseException] = {}  # requests a step failed on, until pop_failed_requests()
        self.failed_steps_in_a_row = 0
        # No text longer than this can fit: no token is longer (a tokenizer that deletes characters would need more)
        self.max_prompt_chars = self.max_model_len * self.tokenizer.max_token_chars
        self.num_generated_tokens = 0  # every sample's, as /metrics' generation_tokens counts them
        self._kv_view: KVView | None = None  # made by the first kv_snapshot
        self._prompt_words: dict[str, str] = {}  # request id -> its prompt's first words, for kv_snapshot
        logger.info("max_model_len %d", self.max_model_len)

    def _max_model_len(self, num_blocks: int) -> int:
        """The model's context, capped by what the pool can hold for one sequence."""
        model_len = self.model_config.max_position_embeddings
        capacity = num_blocks * self.config.block_size
        wanted = self.config.max_model_len
        if wanted is not None and wanted > model_len:
            raise ValueError(f"max_model_len {wanted} exceeds the model's context length {model_len}")
        if wanted is not None and wanted > capacity:
            raise ValueError(f"max_model_len {wanted} does not fit in the KV cache ({capacity} tokens); "
                             "raise kv_cache_memory or num_blocks")
        return wanted or min(model_len, capacity)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids, checked against the vocabulary and the context; a text that
        cannot fit is refused by its length before it is tokenized (that costs time in proportion)."""
        return tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Sequence:
        """Validate and queue a request; bad input raises InvalidRequestError and never reaches the scheduler."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        ids = self.tokenize_prompt(prompt)
        room = self.scheduler.seq_len_limit(params.n) - len(ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens: {params.n} samples of it do not fit in the KV cache")
        spec = params.structured_outputs
        matchers = self.structured.new_matchers(spec, params.n) if spec is not None else []
        seq = Sequence(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                       RequestMetrics(arrival_time or time.time()), max_tokens=min(params.max_tokens or room, room))
        group = SequenceGroup.make(seq)
        self.runner.add_sequences(group.seqs)  # per-request state now: a failure is this request's
        self.groups[request_id] = group
        for s in group.seqs:
            self.detokenizers[s.seq_id] = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        for s, matcher in zip(group.seqs, matchers):  # every sample starts in the grammar's start state
            self.matchers[s.seq_id] = matcher
        self.scheduler.add(group)
        return seq

    def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a structured-output request's grammar ahead of add_request, which then finds it in the cache;
        a grammar the compiler refuses raises InvalidRequestError. Thread-safe: the server calls it off its event
        loop and off the engine's thread, so a big schema's compile stalls neither."""
        return self.structured.compile(spec)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool at once."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish("abort")
        self._release_finished(group)
        return self._output(group)

    def fail_running(self) -> list[RequestOutput]:
        """Abort every running request (after a failed step); their final outputs, blocks back in the pool."""
        outputs = [self.abort_request(g.request_id) for g in list(self.scheduler.running)]
        return [out for out in outputs if out is not None]

    def pop_failed_requests(self) -> dict[str, BaseException]:
        """The requests that steps failed on since the last call, and why (their last output said "abort")."""
        failed, self.failed = self.failed, {}
        return failed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_int4_matmuls(self) -> int:
        """Matmuls that run the checkpoint's 4-bit weights as stored (for small steps)."""
        return self.runner.model.num_int4_matmuls

    def wait_for_kv_cache(self, timeout: float | None = None) -> bool:
        """Wait until the KV pool's memory is mapped (a background thread maps it from start-up, so that no step
        faults pages in); a benchmark starts its clock after this, as vLLM's after zero-filling its cache."""
        return self.runner.prefault.wait(timeout)

    # ---- statistics and control -------------------------------------------------------------------
    def stats(self) -> EngineCounters:
        bm = self.block_manager
        return EngineCounters(bm.prefix_cache_queries, bm.prefix_cache_hits, bm.pool.num_used,
                              bm.pool.num_cached_free, bm.num_total_blocks, bm.num_cow_copies,
                              self.scheduler.num_preemptions, **asdict(self.kv_usage),
                              spec_draft_tokens=self.num_draft_tokens, spec_accepted_tokens=self.num_accepted_tokens)

    def kv_snapshot(self, since: int | None = None) -> KVSnapshot:
        """The KV cache as plain data, for a dashboard or a trace: every held block and each request's block tables;
        with `since` (an earlier snapshot's version) only the blocks changed since. Costs nothing until called."""
        if self._kv_view is None:
            self._kv_view = KVView(self.scheduler)
        snap = self._kv_view.snapshot(since)
        snap.counters.generated_tokens = self.num_generated_tokens
        for request in snap.requests:
            request.prompt = self._first_words(request.request_id)
        if len(self._prompt_words) > 2 * len(self.groups) + 256:
            self._prompt_words = {r: w for r, w in self._prompt_words.items() if r in self.groups}
        return snap

    def _first_words(self, request_id: str, num_words: int = 8) -> str:
        words = self._prompt_words.get(request_id)
        if words is None:
            first = self.groups[request_id].seqs[0]
            text = first.prompt or self.tokenizer.decode(first.prompt_token_ids[:4 * num_words])
            cut = text.split()
            words = " ".join(cut[:num_words]) + (" …" if len(cut) > num_words else "")
            self._prompt_words[request_id] = words
        return words

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer` with a StepRecord after every step that ran the model."""
        self.observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self.observers.remove(observer)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.block_manager.enable_prefix_caching

    @enable_prefix_caching.setter
    def enable_prefix_caching(self, enabled: bool) -> None:
        """Turn the prefix cache on or off for sequences that start from now (a benchmark compares both)."""
        if enabled and self.config.kv_policy != "paged":
            raise ValueError("prefix caching needs kv_policy paged")
        self.block_manager.enable_prefix_caching = enabled

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by free blocks (blocks in use keep theirs), as vLLM's of that name."""
        self.block_manager.pool.evict_cached_free()

    @contextlib.contextmanager
    def step_timers(self) -> Iterator[StepTimers]:
        """Time the parts of every step run inside the block (a benchmark's breakdown; off the hot path otherwise)."""
        with StepTimers(self) as timers:
            yield timers

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of every request that got a token. A request the
        step fails on fails alone (pop_failed_requests); an error that escapes means the engine must be replaced."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if self.faults is not None:
            self.faults.check_engine(plan)
        blocks_in_use = self.block_manager.pool.num_used
        now = time.time()
        for s in plan.scheduled:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        try:
            outputs = self._run(plan)
        except Exception as error:
            outputs = self._isolate(plan, error)
            self.kv_usage.record_step(self.block_manager, self.scheduler.running)
        if self.observers:
            record = StepRecord(plan.num_batched_tokens, len(plan.scheduled), len(plan.preempted), blocks_in_use,
                                outputs)
            for observer in self.observers:
                observer(record)
        return outputs

    def _run(self, plan: SchedulerOutput, whole_step: bool = True) -> list[RequestOutput]:
        """Run the model over the plan, then advance its sequences (nothing advances if the model raises)."""
        if self.faults is not None:
            self.faults.check_model_step(plan)
        sampled = self.runner.execute(plan, self._grammar_mask(plan.sampling_rows) if self.matchers else None)
        emitted = self._accept_drafts(plan, sampled) if sampled is not None else []
        self.scheduler.commit(plan)
        if whole_step:  # KV held vs stored, before finished sequences leave (a failed step counts once, at its end)
            self.kv_usage.record_step(self.block_manager, self.scheduler.running)
        if sampled is None:
            return []
        return self._process_outputs(emitted, sampled)

    def _accept_drafts(self, plan: SchedulerOutput, sampled: SamplerOutput) -> list[tuple[Sequence, int, int]]:
        """(sequence, its first row, tokens it gets) per sampler. A speculative decode keeps its proposed tokens up
        to the first the model's own pick differs from, and gets those picks plus the next one: exactly the tokens
        one-token greedy steps would give. Its `draft` and chunk are cut to what was accepted (commit's input)."""
        emitted, row = [], 0
        picks = sampled.token_ids.tolist() if any(s.draft for s in plan.scheduled) else None
        for s in plan.scheduled:
            if s.draft and picks is not None:  # one sampler (n == 1), 1 + len(draft) rows
                proposed = len(s.draft)
                accepted = next((i for i, t in enumerate(s.draft) if t != picks[row + i]), proposed)
                self.num_draft_tokens += proposed
                self.num_accepted_tokens += accepted
                s.num_new_tokens -= proposed - accepted
                s.draft = s.draft[:accepted]
                emitted.append((s.seq, row, accepted + 1))
                row += proposed + 1
                continue
            for seq in s.samplers:
                emitted.append((seq, row, 1))
                row += 1
        self.num_generated_tokens += sum(n for _, _, n in emitted)
        return emitted

    # ---- a failed step ----------------------------------------------------------------------------
    def _isolate(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Rerun the failed step's requests in parts (those already decoding apart from those still in their prompt,
        then halves) until each part runs or is one request, which fails alone. Nothing was committed, so a part
        recomputes its chunk exactly; the others keep their tokens and blocks."""
        groups = list(dict.fromkeys(self.groups[s.seq.request_id] for s in plan.scheduled))
        logger.warning("a step of %d requests failed (%r); rerunning it in parts to find the request at fault",
                       len(groups), error)
        outputs: list[RequestOutput] = []
        failed: list[SequenceGroup] = []
        decoding = [g for g in groups if g.is_decoding]
        prompts = [g for g in groups if not g.is_decoding]  # the newest admissions are here
        parts = [decoding, prompts] if decoding and prompts else self._halves(groups)
        for part in parts if len(groups) > 1 else []:
            self._run_part(plan, part, outputs, failed)
        if len(groups) == 1:
            self._fail_request(groups[0], error)
            failed.append(groups[0])
        outputs += [self._output(g) for g in failed]
        self.block_manager.check()  # a failure must leave the pool consistent, or the engine is replaced
        if len(failed) == len(groups):
            self.failed_steps_in_a_row += 1
            if len(groups) > 1 or self.failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise EngineBrokenError(f"the model failed on every request of {self.failed_steps_in_a_row} "
                                        f"step(s) in a row, even alone: {error!r}") from error
        else:
            self.failed_steps_in_a_row = 0
        return outputs

    def _run_part(self, plan: SchedulerOutput, part: list[SequenceGroup], outputs: list[RequestOutput],
                  failed: list[SequenceGroup]) -> None:
        sub = self._subplan(plan, part)
        try:
            outputs += self._run(sub, whole_step=False)
        except Exception as error:
            if len(part) > 1:
                for half in self._halves(part):
                    self._run_part(plan, half, outputs, failed)
                return
            logger.error("request %s failed its step alone; failing it: %r", part[0].request_id, error)
            self._fail_request(part[0], error)
            failed.append(part[0])

    @staticmethod
    def _halves(groups: list[SequenceGroup]) -> list[list[SequenceGroup]]:
        return [groups[:len(groups) // 2], groups[len(groups) // 2:]]

    @staticmethod
    def _subplan(plan: SchedulerOutput, part: list[SequenceGroup]) -> SchedulerOutput:
        """The plan's share of `part`, with the copy-on-write copies into its own blocks (copying again is
        harmless: the source blocks' shared prefix has not changed)."""
        seqs = {id(seq) for g in part for seq in g.seqs}
        scheduled = [s for s in plan.scheduled if id(s.seq) in seqs]
        own = {b for s in scheduled for b in s.block_table}
        return SchedulerOutput(budget=0, scheduled=scheduled, copies=[c for c in plan.copies if c[1] in own])

    def _fail_request(self, group: SequenceGroup, error: BaseException) -> None:
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish("abort")
        self._release_finished(group)
        self.failed[group.request_id] = error

    # ---- outputs ----------------------------------------------------------------------------------
    def _grammar_mask(self, sampling: list[Sequence]) -> GrammarMask | None:
        """The next tokens each structured-output sequence's grammar allows, for its sampling row; None if no
        sequence of the step has a grammar."""
        rows = [(row, m) for row, seq in enumerate(sampling) if (m := self.matchers.get(seq.seq_id)) is not None]
        if not rows:
            return None
        return GrammarMask(torch.tensor([row for row, _ in rows], dtype=torch.int64),
                           self.structured.fill_bitmask([m for _, m in rows]))

    def _process_outputs(self, emitted: list[tuple[Sequence, int, int]], sampled: SamplerOutput,
                         ) -> list[RequestOutput]:
        """Each sampled token through the stop checks and the detokenizer, in order (a sequence that stops drops the
        rest of its step's tokens); a request that raises here fails alone."""
        touched: dict[str, SequenceGroup] = {}
        errors: dict[str, Exception] = {}
        for seq, first_row, count in emitted:
            if seq.request_id in errors:
                continue
            try:
                for row in range(first_row, first_row + count):
                    if not seq.is_finished:
                        self._process_token(seq, sampled, row)
            except Exception as e:
                logger.exception("request %s failed while its token was processed", seq.request_id)
                errors[seq.request_id] = e
            touched.setdefault(seq.request_id, self.groups[seq.request_id])
        for request_id, error in errors.items():
            self._fail_request(touched[request_id], error)
        for group in touched.values():
            self._release_finished(group)
        return [self._output(group) for group in touched.values()]

    def _process_token(self, seq: Sequence, sampled: SamplerOutput, row: int) -> None:
        token = int(sampled.token_ids[row])
        seq.append_token(token, float(sampled.logprobs[row]))
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(seq, token, sampled, row))
        now = time.time()
        seq.metrics.first_token_time = seq.metrics.first_token_time or now
        matcher = self.matchers.get(seq.seq_id)
        grammar_done = matcher is not None and self._advance_grammar(seq, matcher, token)
        if self._is_stop_token(seq, token):  # its text is not part of the output
            seq.finish("stop", token if token in seq.params.stop_token_ids else None)
        else:
            delta = self.detokenizers[seq.seq_id].step([token])
            seq.output_text += delta
            self._check_stop_strings(seq, len(delta))
        if not seq.is_finished and grammar_done:  # only EOS could follow: end now, without a step for it
            seq.finish("stop")
        if not seq.is_finished and (seq.num_output_tokens >= seq.max_tokens):
            seq.finish("length")

    @staticmethod
    def _advance_grammar(seq: Sequence, matcher: Any, token: int) -> bool:
        """Move the sequence's grammar past its new token; True when the grammar is complete. A token the grammar
        refuses fails the request (structured_output.advance_grammar): the output could not be what it asked for."""
        return advance_grammar(matcher, token)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        if seq.num_output_tokens <= p.min_tokens:  # the sampler masked stop tokens until now
            return False
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def _check_stop_strings(self, seq: Sequence, new_chars: int) -> None:
        """Search only the tail a new token could have completed; cut the text at the stop string."""
        p = seq.params
        if not p.stop_list or seq.num_output_tokens < p.min_tokens:
            return
        for stop in p.stop_list:
            at = seq.output_text.find(stop, max(0, len(seq.output_text) - new_chars - len(stop) + 1))
            if at != -1:
                end = at + len(stop) if p.include_stop_str_in_output else at
                seq.output_text = seq.output_text[:end]
                seq.finish("stop", stop)
                return

    def _logprob_entry(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int) -> dict[int, Logprob]:
        """The chosen token's logprob and rank, plus the request's top-k alternatives, as vLLM reports them."""
        decode = self.tokenizer.decode
        entry = {token: Logprob(float(sampled.logprobs[row]), int(sampled.ranks[row]),
                                decode([token], skip_special_tokens=False))}
        if sampled.top_logprobs is not None and seq.params.logprobs:
            ids, values = sampled.top_logprobs
            k = seq.params.logprobs
            for rank, (tid, val) in enumerate(zip(ids[row, :k].tolist(), values[row, :k].tolist()), start=1):
                entry.setdefault(tid, Logprob(val, rank, decode([tid], skip_special_tokens=False)))
        return entry

    def _release_finished(self, group: SequenceGroup) -> None:
        """Blocks, generators and detokenizers of finished samples go at once; the group when all are done."""
        self.scheduler.finish(group)
        for seq in group.seqs:
            if seq.is_finished:
                self.runner.release(seq.seq_id)
                self.detokenizers.pop(seq.seq_id, None)
                self.matchers.pop(seq.seq_id, None)
        if group.is_finished:
            group.seqs[0].metrics.finished_time = time.time()
            self.groups.pop(group.request_id, None)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        first = group.seqs[0]
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids,
                             [self._completion(seq) for seq in group.seqs], group.is_finished, first.metrics)

    @staticmethod
    def _completion(seq: Sequence) -> CompletionOutput:
        text = seq.output_text
        holdback = max((len(s) for s in seq.params.stop_list), default=1) - 1
        if not seq.is_finished and holdback:
            text = text[:max(0, len(text) - holdback)]  # a stop string may still complete here
        return CompletionOutput(
            index=seq.index, text=text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs and list(seq.logprobs),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def check_invariants(self) -> None:
        self.block_manager.check()
