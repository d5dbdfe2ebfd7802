"""What a step's sampled tokens do to their sequences: stop tokens and strings, incremental detokenization, the
grammar's state, logprobs; and the RequestOutput a request's state makes. The engine's step calls it after the model."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.engine.structured_output import (
    GrammarBrokenError,
    MaskBudget,
    StructuredOutputManager,
    advance_grammar,
)
from pagedllm.lora_request import LoRARequest
from pagedllm.model.sampler import GrammarMask, SamplerOutput
from pagedllm.model.timing import NO_TIMER, PartTimer
from pagedllm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger("pagedllm")

Emitted = list[tuple[Sequence, int, int]]  # (sequence, its first sampled row, the tokens it gets) in row order


@dataclass
class PendingFill:
    """A step's grammar mask on the mask thread: each constrained sequence, and the CPU seconds of its first row once
    filled."""

    seqs: list[Sequence]
    costs: list[float]
    future: Future[torch.Tensor]


class OutputProcessor:
    """Per-sample state between steps (a detokenizer, a grammar matcher) and the checks each new token goes through."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Collection[int],
                 structured: StructuredOutputManager) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.structured = structured
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}  # by seq_id
        self.matchers: dict[int, Any] = {}  # by seq_id: the grammar state of structured-output sequences
        self.grammar_requests: dict[int, str] = {}  # by seq_id: the request of each sequence with a grammar
        self.mask_budget = MaskBudget()
        self._filling: PendingFill | None = None  # the step's mask, while the mask thread fills it
        self._over_budget: dict[str, GrammarBrokenError] = {}  # requests the last fills put over the mask budget
        self.set_timer(NO_TIMER)

    def set_timer(self, timer: PartTimer) -> None:
        """Time detokenization under `timer` (bench latency); NO_TIMER leaves the plain call."""
        self.detokenize = timer.timed("detokenize", IncrementalDetokenizer.step)

    def add(self, seqs: list[Sequence], matchers: list[Any]) -> None:
        """Each sample's detokenizer and, for a structured output, its grammar in the start state."""
        for seq in seqs:
            self.detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                                   seq.params.skip_special_tokens)
        for seq, matcher in zip(seqs, matchers):
            self.matchers[seq.seq_id] = matcher
            self.grammar_requests[seq.seq_id] = seq.request_id

    def release(self, seq_id: int) -> None:
        self.detokenizers.pop(seq_id, None)
        self.matchers.pop(seq_id, None)
        self.grammar_requests.pop(seq_id, None)

    def grammar_mask(self, plan: SchedulerOutput) -> GrammarMask | None:
        """The next tokens each structured-output sequence's grammar allows, for its sampling rows (a draft's rows
        after its proposed tokens), filled on the mask thread while the model runs (the sampler waits for it); None if
        no sequence of the step has a grammar."""
        self.finish_fill()  # a step that failed before sampling may have left one filling
        if not self.matchers:
            return None
        rows: list[int] = []
        seqs: list[Sequence] = []
        drafts: list[list[int]] = []
        row = 0
        for s in plan.scheduled:
            for seq in s.samplers:
                if seq.seq_id in self.matchers:
                    rows.extend(range(row, row + 1 + len(s.draft)))
                    seqs.append(seq)
                    drafts.append(s.draft)
                row += 1 + len(s.draft)
        if not rows:
            return None
        costs: list[float] = []
        future = self.structured.start_fill([self.matchers[seq.seq_id] for seq in seqs], costs, drafts)
        self._filling = PendingFill(seqs, costs, future)
        return GrammarMask(torch.tensor(rows, dtype=torch.int64), future)

    def finish_fill(self) -> None:
        """Wait for the step's mask (its matchers move next), charge each request its first rows' CPU time, note those
        now over the mask budget, and cap each sequence's next proposals to what its budget leaves room for."""
        filling, self._filling = self._filling, None
        if filling is None or filling.future.exception() is not None:  # a failed fill failed its step already
            return
        costs: dict[str, float] = {}
        for seq, seconds in zip(filling.seqs, filling.costs):
            costs[seq.request_id] = costs.get(seq.request_id, 0.0) + seconds
        for seq in filling.seqs:
            seq.max_draft = self.mask_budget.draft_room(costs[seq.request_id])
        if len(self.mask_budget) > 2 * len(self.grammar_requests) + 64:
            self.mask_budget.keep_only(set(self.grammar_requests.values()))
        self._over_budget.update(self.mask_budget.charge(costs))

    def process(self, emitted: Emitted, sampled: SamplerOutput) -> dict[str, Exception | None]:
        """Each sampled token through the stop checks and the detokenizer, in order (a sequence that stops drops the
        rest of its step's tokens). Every request touched, in order, with the error it raised (it fails alone)."""
        touched: dict[str, Exception | None] = {}
        self.finish_fill()
        over_budget, self._over_budget = self._over_budget, {}
        for seq, first_row, count in emitted:
            if touched.get(seq.request_id) is not None:
                continue
            touched.setdefault(seq.request_id, over_budget.get(seq.request_id))
            if touched[seq.request_id] is not None:
                continue
            try:
                for row in range(first_row, first_row + count):
                    if not seq.is_finished:
                        self.process_token(seq, sampled, row)
            except Exception as e:
                logger.exception("request %s failed while its token was processed", seq.request_id)
                touched[seq.request_id] = e
        return touched

    def process_token(self, seq: Sequence, sampled: SamplerOutput, row: int) -> None:
        token = int(sampled.token_ids[row])
        seq.append_token(token, float(sampled.logprobs[row]))
        if seq.logprobs is not None:
            seq.logprobs.append(self.logprob_entry(seq, token, sampled, row))
        seq.metrics.first_token_time = seq.metrics.first_token_time or time.time()
        matcher = self.matchers.get(seq.seq_id)
        grammar_done = matcher is not None and advance_grammar(matcher, token)
        if self.is_stop_token(seq, token):  # its text is not part of the output
            seq.finish("stop", token if token in seq.params.stop_token_ids else None)
        else:
            delta = self.detokenize(self.detokenizers[seq.seq_id], [token])
            seq.output_text += delta
            check_stop_strings(seq, len(delta))
        if not seq.is_finished and grammar_done:  # only EOS could follow: end now, without a step for it
            seq.finish("stop")
        if not seq.is_finished and (seq.num_output_tokens >= seq.max_tokens):
            seq.finish("length")

    def is_stop_token(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        if seq.num_output_tokens <= p.min_tokens:  # the sampler masked stop tokens until now
            return False
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def logprob_entry(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int) -> dict[int, Logprob]:
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


def check_stop_strings(seq: Sequence, new_chars: int) -> None:
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


def request_output(group: SequenceGroup, lora_request: LoRARequest | None = None) -> RequestOutput:
    """What a request has so far, every sample of it."""
    first = group.seqs[0]
    return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids,
                         [completion(seq) for seq in group.seqs], group.is_finished, first.metrics, lora_request)


def completion(seq: Sequence) -> CompletionOutput:
    text = seq.output_text
    holdback = max((len(s) for s in seq.params.stop_list), default=1) - 1
    if not seq.is_finished and holdback:
        text = text[:max(0, len(text) - holdback)]  # a stop string may still complete here
    return CompletionOutput(
        index=seq.index, text=text, token_ids=list(seq.output_token_ids),
        cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs and list(seq.logprobs),
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
