"""The engine: requests in, one scheduled model step at a time, outputs out."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm.attention import is_fast_path_available
from pagedllm.block_manager import BlockManager
from pagedllm.config import EngineConfig
from pagedllm.layers import INT4_MAX_ROWS
from pagedllm.llama import LlamaModel
from pagedllm.loader import load_model
from pagedllm.model_runner import ModelRunner, kv_bytes_per_block
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampler import SamplerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler
from pagedllm.sequence import Sequence, SequenceGroup
from pagedllm.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("pagedllm")


@dataclass
class EngineCounters:
    """What the engine did with its KV blocks so far (prefix cache figures are in tokens)."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    blocks_in_use: int
    blocks_cached_free: int
    cow_copies: int
    preemptions: int
    kv_slots_held: int  # last step: KV token slots in blocks held by running sequences (a shared block once)
    kv_tokens_stored: int  # last step: tokens stored in them
    kv_slots_held_sum: int  # summed over steps
    kv_tokens_stored_sum: int
    kv_steps: int  # steps summed
    peak_num_running: int  # most sequences running in one step

    @property
    def kv_waste_fraction(self) -> float:
        """Share of the held KV slots that stored nothing, over the run so far (tails of last blocks under paging,
        unused reservations under the reservation policies)."""
        return 1 - self.kv_tokens_stored_sum / self.kv_slots_held_sum if self.kv_slots_held_sum else 0.0


class LLMEngine:
    """Owns the scheduler and the model runner; `step()` runs one iteration of continuous batching."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        dtype = getattr(torch, config.torch_dtype_name)
        keep_4bit = config.quantization == "auto" and config.attention_backend != "reference"
        loaded = load_model(config.model, dtype, keep_4bit=keep_4bit and dtype == torch.bfloat16)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        num_blocks = config.num_blocks or config.kv_cache_bytes // kv_bytes_per_block(
            loaded.config, config.block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {config.kv_cache_memory!r} holds no block of {config.block_size} tokens")
        self.max_model_len = self._max_model_len(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.kv_policy, config.batching)
        if config.attention_backend != "reference":
            is_fast_path_available()  # compile (or load the cached build of) the C++ kernel now, not on a request
        model = LlamaModel(loaded.config, loaded.weights, dtype, config.attention_backend, loaded.q4_weights)
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.eos_token_ids)
        self.groups: dict[str, SequenceGroup] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}  # by seq_id
        logger.info("loaded %s (%s, %d matmuls with 4-bit weights for batches of up to %d rows), %d KV blocks of "
                    "%d tokens, max_model_len %d", self.model_name, config.torch_dtype_name, model.num_int4_matmuls,
                    INT4_MAX_ROWS, num_blocks, config.block_size, self.max_model_len)

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
        """Token ids of a prompt given as text or ids, checked against the vocabulary and the context."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                             "(it must leave room for at least one generated token)")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Sequence:
        """Validate and queue a request; bad input raises ValueError and never reaches the scheduler."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        ids = self.tokenize_prompt(prompt)
        room = self.scheduler.seq_len_limit(params.n) - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens: {params.n} samples of it do not fit in the KV cache")
        seq = Sequence(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                       RequestMetrics(arrival_time or time.time()), max_tokens=min(params.max_tokens or room, room))
        group = SequenceGroup.make(seq)
        self.groups[request_id] = group
        for s in group.seqs:
            self.detokenizers[s.seq_id] = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.scheduler.add(group)
        return seq

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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineCounters:
        pool = self.block_manager.pool
        return EngineCounters(self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits, pool.num_used,
                              pool.num_cached_free, self.block_manager.num_cow_copies, self.scheduler.num_preemptions,
                              **asdict(self.scheduler.kv_usage))

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of every request that got a token."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        now = time.time()
        for s in plan.scheduled:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        sampled = self.runner.execute(plan, self.block_manager.block_tables)
        self.scheduler.commit(plan)
        sampling = [seq for s in plan.scheduled for seq in s.samplers]
        if sampled is None:
            return []
        touched: dict[str, SequenceGroup] = {}
        for row, seq in enumerate(sampling):
            self._process_token(seq, sampled, row)
            touched.setdefault(seq.request_id, self.groups[seq.request_id])
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
        if self._is_stop_token(seq, token):  # its text is not part of the output
            seq.finish("stop", token if token in seq.params.stop_token_ids else None)
        else:
            delta = self.detokenizers[seq.seq_id].step([token])
            seq.output_text += delta
            self._check_stop_strings(seq, len(delta))
        if not seq.is_finished and (seq.num_output_tokens >= seq.max_tokens):
            seq.finish("length")

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
