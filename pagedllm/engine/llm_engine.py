"""The engine: requests in, one scheduled model step at a time, outputs out."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.baselines import make_scheduler
from pagedllm.core.kv_stats import EngineCounters as EngineCounters  # stats() returns it, imported from here
from pagedllm.core.kv_stats import KVUsage
from pagedllm.core.kv_view import KVSnapshot, KVView
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.core.service import ServiceLedger
from pagedllm.engine.faults import FaultInjector
from pagedllm.engine.isolation import EngineBrokenError as EngineBrokenError  # raised by step(), imported from here
from pagedllm.engine.isolation import StepIsolation
from pagedllm.engine.kv_offload import KVTier
from pagedllm.engine.output_processor import Emitted, OutputProcessor, request_output
from pagedllm.engine.prompts import tokenize_prompt
from pagedllm.engine.step_timers import StepTimers
from pagedllm.engine.structured_output import CompiledGrammar, StructuredOutputManager
from pagedllm.errors import InvalidRequestError
from pagedllm.lora_request import LoRARequest
from pagedllm.model.loader import ModelConfig
from pagedllm.model.loader import load_tokenizer as load_tokenizer  # entrypoints load tokenizers through the engine
from pagedllm.model.loader.peft import LoRAAdapter, LoRALoadError
from pagedllm.model.model_runner import ModelRunner
from pagedllm.model.sampler import SamplerOutput
from pagedllm.model.timing import NO_TIMER, PartTimer
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm")


@dataclass
class StepRecord:
    """What one step did, for step observers: `blocks_in_use` is counted while the step's forward held them."""

    num_batched_tokens: int
    num_scheduled_seqs: int
    num_preempted: int
    blocks_in_use: int
    outputs: list[RequestOutput]


StepObserver = Callable[[StepRecord], None]


class LLMEngine:
    """Owns the scheduler and the model runner; `step()` runs one iteration of continuous batching."""

    def __init__(self, config: EngineConfig, faults: FaultInjector | None = None) -> None:
        self.config = config
        self.faults = faults or FaultInjector.from_env()  # tests only
        self.runner, self.tokenizer, self.model_name = ModelRunner.from_config(config)
        self.model_config: ModelConfig = self.runner.model_config
        self.eos_token_ids = set(self.runner.eos_token_ids)
        self.max_model_len = self._max_model_len(self.runner.num_blocks)
        self.scheduler = make_scheduler(dataclasses.replace(config.scheduler_config, max_model_len=self.max_model_len,
                                                            max_num_batched_tokens=self._step_budget()),
                                        self.runner.num_blocks)
        self.block_manager = self.scheduler.block_manager
        # the prefix cache's second tier (--kv-offload-dir): blocks the pool lets go, restored on a later prefix hit
        self.kv_tier = KVTier.open(config, self.runner) if config.kv_offload_dir else None
        self.block_manager.tier = self.kv_tier
        self.num_draft_tokens = 0  # proposed tokens verified, and those accepted (vLLM's spec_decode counters)
        self.num_accepted_tokens = 0
        self.kv_usage = KVUsage()
        self.service = ServiceLedger()  # per client: requests, tokens, queue time, weighted service (every policy)
        self.groups: dict[str, SequenceGroup] = {}
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.structured)
        own = weakref.proxy(self)  # callbacks that kept the engine alive (a cycle) held its model until gc ran
        self.isolation = StepIsolation(lambda plan: own._run(plan, whole_step=False),
                                       lambda group, error: own._fail_request(group, error), self.block_manager.check)
        self.timer: PartTimer = NO_TIMER  # a StepTimers inside step_timers()
        self.observers: list[StepObserver] = []
        self.failed: dict[str, BaseException] = {}  # requests a step failed on, until pop_failed_requests()
        # No text longer than this can fit: no token is longer (a tokenizer that deletes characters would need more)
        self.max_prompt_chars = self.max_model_len * self.tokenizer.max_token_chars
        self.num_generated_tokens = 0  # every sample's, as /metrics' generation_tokens counts them
        self._kv_view: KVView | None = None  # made by the first kv_snapshot
        self._prompt_words: dict[str, str] = {}  # request id -> its prompt's first words, for kv_snapshot
        self.loras: dict[int, LoRARequest] = {}  # the registered LoRA adapters by id
        logger.info("max_model_len %d", self.max_model_len)

    def _step_budget(self) -> int:
        """--max-num-batched-tokens, or the budget chosen for this machine and model (logged with its reason)."""
        if self.config.max_num_batched_tokens is not None:
            return self.config.max_num_batched_tokens
        budget = self.runner.step_budget()
        logger.info("step budget %d tokens (--max-num-batched-tokens): %s", budget.tokens, budget.reason)
        return budget.tokens

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget in force: the flag's, or the one chosen here."""
        return self.scheduler.max_num_batched_tokens

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
        if wanted is None and capacity < model_len:
            logger.warning("max_model_len is %d, the tokens the KV cache holds (%d blocks of %d), below the model's "
                           "context of %d: raise --kv-cache-memory or --num-blocks for longer sequences", capacity,
                           num_blocks, self.config.block_size, model_len)
        return wanted or min(model_len, capacity)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids, checked against the vocabulary and the context; a text that
        cannot fit is refused by its length before it is tokenized (that costs time in proportion)."""
        return tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int | None = None,
                    lora_request: LoRARequest | None = None) -> Sequence:
        """Validate and queue a request; bad input raises InvalidRequestError and never reaches the scheduler.
        `priority` (vLLM's argument) stands for params.priority; `lora_request`: the adapter it runs with (loaded now
        if its id is new)."""
        params = params or SamplingParams()
        if lora_request is not None:
            self.add_lora(lora_request)
        if priority is not None:
            params = dataclasses.replace(params, priority=priority)
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        ids = self.tokenize_prompt(prompt)
        lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        room = self.scheduler.seq_len_limit(params.n, lora_int_id) - len(ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens: {params.n} samples of it do not fit in the KV cache")
        spec = params.structured_outputs
        matchers = self.structured.new_matchers(spec, params.n) if spec is not None else []
        metrics = RequestMetrics(arrival_time or time.time(), client=params.client, priority=params.priority)
        seq = Sequence(request_id, prompt if isinstance(prompt, str) else None, ids, params, metrics,
                       max_tokens=min(params.max_tokens or room, room), lora_int_id=lora_int_id)
        group = SequenceGroup.make(seq)
        self.runner.add_sequences(group.seqs)  # per-request state now: a failure is this request's
        self.groups[request_id] = group
        self.output_processor.add(group.seqs, matchers)
        self.scheduler.add(group)
        return seq

    # ---- LoRA adapters ----------------------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter, reading its folder now (LoRALoadError, a 400, if it cannot serve on this model);
        False if its id is registered already."""
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if known.lora_name != lora_request.lora_name:
                raise InvalidRequestError(f"LoRA id {lora_request.lora_int_id} is adapter {known.lora_name!r}")
            return False
        self.add_read_lora(lora_request, self.read_lora(lora_request))
        return True

    def read_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """An adapter's weights read and checked, without registering them: thread-safe, so a server reads files
        off its event loop and off the engine's thread, then hands them to add_read_lora."""
        if not self.config.enable_lora:
            raise InvalidRequestError("LoRA adapters need enable_lora (--enable-lora)")
        adapter = self.runner.read_adapter(lora_request.lora_path)
        blocks = self.runner.adapter_blocks(adapter)
        if blocks >= self.block_manager.num_total_blocks:
            raise LoRALoadError(f"{lora_request.lora_path}: the adapter's weights ({adapter.nbytes / 2**20:.1f} MiB) "
                                f"would take {blocks} of the KV cache's {self.block_manager.num_total_blocks} blocks; "
                                "raise --kv-cache-memory")
        return adapter

    def add_read_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Register an adapter read by read_lora; its weights will count as blocks of the pool while resident."""
        self.runner.add_adapter(lora_request.lora_int_id, adapter, lora_request.lora_path)
        self.scheduler.adapters.sizes[lora_request.lora_int_id] = self.runner.adapter_blocks(adapter)
        self.loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter no request uses (InvalidRequestError if one does); False if it is not registered."""
        if lora_int_id not in self.loras:
            return False
        users = [g.request_id for g in self.groups.values() if g.lora_int_id == lora_int_id]
        if users or not self.scheduler.adapters.forget(lora_int_id):
            raise InvalidRequestError(f"LoRA adapter {self.loras[lora_int_id].lora_name!r} is in use by "
                                      f"{len(users)} request(s)")
        self.runner.remove_adapter(lora_int_id)
        del self.loras[lora_int_id]
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())

    def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a structured-output request's grammar ahead of add_request, which then finds it in the cache;
        a grammar the compiler refuses raises InvalidRequestError. Thread-safe: the server calls it off its event
        loop and off the engine's thread, so a big schema's compile stalls neither."""
        return self.structured.compile(spec)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool at once."""
        group = self.groups.get(request_id)
        out = self._abort(group) if group is not None else None
        self._save_when_idle()
        return out

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

    @property
    def int8_lm_head(self) -> bool:
        """The lm_head was built with an int8 form (VNNI, top candidates rescored) that its route may give steps."""
        return "lm_head" in self.runner.model.int8

    def wait_for_kv_cache(self, timeout: float | None = None) -> bool:
        """Wait until the KV pool's memory is mapped (a background thread maps it from start-up, so that no step
        faults pages in); a benchmark starts its clock after this, as vLLM's after zero-filling its cache."""
        return self.runner.prefault.wait(timeout)

    # ---- statistics and control -------------------------------------------------------------------
    def stats(self) -> EngineCounters:
        bm = self.block_manager
        tier = {"hits": bm.tier_hits, "misses": bm.tier_misses, **self.kv_tier.stats()} if self.kv_tier else {}
        return EngineCounters(bm.prefix_cache_queries, bm.prefix_cache_hits, bm.pool.num_used,
                              bm.pool.num_cached_free, bm.num_total_blocks, bm.num_cow_copies,
                              self.scheduler.num_preemptions, **asdict(self.kv_usage),
                              spec_draft_tokens=self.num_draft_tokens, spec_accepted_tokens=self.num_accepted_tokens,
                              spec_gate=self.scheduler.gate.table(), kv_tier=tier,
                              lora_adapters_loaded=len(self.loras),
                              lora_adapters_resident=len(self.scheduler.adapters.slot_of),
                              lora_adapter_blocks=bm.num_adapter_blocks, lora_loads=self.scheduler.adapters.num_loads)

    def flush_kv_tier(self, timeout: float | None = None) -> bool:
        """Wait until the second tier has written every block let go so far (a benchmark or a test before it
        restarts); True at once without a tier."""
        return self.kv_tier.flush(timeout) if self.kv_tier else True

    def close(self) -> None:
        """Save what the second tier still holds and let go of its directory, so that another engine (this process's
        or another's) writes it next; the engine is not used after. Without a tier, nothing to do."""
        if self.kv_tier is not None:
            self.kv_tier.close()
            self.kv_tier = self.block_manager.tier = None

    def kv_snapshot(self, since: int | None = None) -> KVSnapshot:
        """The KV cache as plain data, for a dashboard or a trace: every held block and each request's block tables;
        with `since` (an earlier snapshot's version) only the blocks changed since. Costs nothing until called."""
        if self._kv_view is None:
            self._kv_view = KVView(self.scheduler)
        snap = self._kv_view.snapshot(since)
        snap.counters.generated_tokens = self.num_generated_tokens
        snap.clients = self.service.table()
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
        """Time the parts of every step run inside the block (a benchmark's breakdown): the engine, the output
        processor, the model runner and the model each run their parts under the timer while it is set."""
        timers = StepTimers()
        self._set_timer(timers)
        try:
            yield timers
        finally:
            self._set_timer(NO_TIMER)

    def _set_timer(self, timer: PartTimer) -> None:
        self.timer = timer
        self.output_processor.set_timer(timer)
        self.runner.set_timer(timer)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, commit, process its tokens. A request the step fails on fails alone
        (pop_failed_requests); an error that escapes means the engine must be replaced."""
        began, generated = time.perf_counter(), self.num_generated_tokens
        with self.timer.part("schedule"):
            self.service.note_waiting(self.scheduler.waiting)
            plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        blocks_in_use = self._start(plan)
        pure_decode = self.scheduler.gate.deciding and plan.is_pure_decode  # only a step the gate chose for
        rows = plan.num_batched_tokens  # before the drafts are cut to what was accepted
        try:
            outputs = self._run(plan)
        except Exception as error:
            groups = list(dict.fromkeys(self.groups[s.seq.request_id] for s in plan.scheduled))
            outputs = self.isolation.rerun(plan, groups, error)
            self.kv_usage.record_step(self.block_manager, self.scheduler.running)
            pure_decode = False
        seconds = time.perf_counter() - began
        self.scheduler.gate.record(self.num_generated_tokens - generated, seconds, pure_decode, rows)
        self.service.end_step(plan)
        if self.observers:
            self._notify(StepRecord(plan.num_batched_tokens, len(plan.scheduled), len(plan.preempted), blocks_in_use,
                                    outputs))
        self._save_when_idle()
        return outputs

    def _save_when_idle(self) -> None:
        """With nothing left to run, hand the second tier's writer what was let go (no next step would)."""
        if self.kv_tier is not None and not self.scheduler.has_unfinished():
            self.kv_tier.copy_out()

    def _start(self, plan: SchedulerOutput) -> int:
        """Stamp first-scheduled times; the blocks in use while the step holds them (for its StepRecord)."""
        if self.faults is not None:
            self.faults.check_engine(plan)
        now = time.time()
        self.service.start_step(plan, now)  # before the stamps: an unstamped request is charged its prompt
        for s in plan.scheduled:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        return self.block_manager.pool.num_used

    def _run(self, plan: SchedulerOutput, whole_step: bool = True) -> list[RequestOutput]:
        """Run the model over the plan, then advance its sequences (nothing advances if the model raises)."""
        if self.faults is not None:
            self.faults.check_model_step(plan)
        if self.kv_tier is not None:  # blocks let go are copied out before the forward may overwrite them
            self.kv_tier.copy_out()
        sampled = self.runner.execute(plan, self.output_processor.grammar_mask(plan))
        emitted = self._accept_drafts(plan, sampled) if sampled is not None else []
        with self.timer.part("schedule"):
            self.scheduler.commit(plan)
            if whole_step:  # KV held vs stored, before finished sequences leave (a failed step counts at its end)
                self.kv_usage.record_step(self.block_manager, self.scheduler.running)
        if sampled is None:
            return []
        with self.timer.part("output"):
            return self._process(emitted, sampled)

    def _notify(self, record: StepRecord) -> None:
        for observer in self.observers:
            observer(record)

    def _accept_drafts(self, plan: SchedulerOutput, sampled: SamplerOutput) -> Emitted:
        """(sequence, its first row, tokens it gets) per sampler. A speculative decode keeps its proposed tokens up
        to the first the model's own pick differs from, and gets those picks plus the next one: the tokens one-token
        greedy steps would give, or for a sampled row the distribution of one-token draws (Sequence.may_speculate).
        Its `draft` and chunk are cut to what was accepted (commit's input)."""
        emitted, row = [], 0
        picks = sampled.token_ids.tolist() if any(s.draft for s in plan.scheduled) else None
        for s in plan.scheduled:
            if s.draft and picks is not None:  # a decode: one sampler (samples fork at the prompt), 1 + len(draft) rows
                proposed = len(s.draft)
                accepted = next((i for i, t in enumerate(s.draft) if t != picks[row + i]), proposed)
                self.num_draft_tokens += proposed
                self.num_accepted_tokens += accepted
                s.seq.lookup.record(proposed, accepted)
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

    def _process(self, emitted: Emitted, sampled: SamplerOutput) -> list[RequestOutput]:
        """The tokens through the output processor; a request that raised there fails alone; finished samples go."""
        touched = [(self.groups[request_id], error)
                   for request_id, error in self.output_processor.process(emitted, sampled).items()]
        for group, error in touched:
            if error is not None:
                self._fail_request(group, error)
            else:
                self._release_finished(group)
        return [self._output(group) for group, _ in touched]

    def _fail_request(self, group: SequenceGroup, error: BaseException) -> RequestOutput:
        """Abort the request and keep why, for pop_failed_requests; its final output."""
        self.failed[group.request_id] = error
        return self._abort(group)

    def _abort(self, group: SequenceGroup) -> RequestOutput:
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish("abort")
        self._release_finished(group)
        return self._output(group)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        return request_output(group, self.loras.get(group.lora_int_id))

    def _release_finished(self, group: SequenceGroup) -> None:
        """Blocks, generators and detokenizers of finished samples go at once; the group when all are done."""
        self.scheduler.finish(group)
        for seq in group.seqs:
            if seq.is_finished:
                self.runner.release(seq.seq_id)
                self.output_processor.release(seq.seq_id)
        if group.is_finished:
            group.seqs[0].metrics.finished_time = time.time()
            self.groups.pop(group.request_id, None)

    def check_invariants(self) -> None:
        self.block_manager.check()
