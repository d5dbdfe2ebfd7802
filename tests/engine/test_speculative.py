"""Speculative decoding by prompt lookup: a greedy sequence's tokens are those of one-token steps (transformers' in
fp32) whatever the proposals, the chunking, the block size or preemption; proposals are really verified and accepted;
every block comes back; it stays off where it must."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest
import torch
from test_engine import MAX_TOKENS, assert_matches_reference, greedy, hf_greedy, mixed_prompts

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.core.ngram import MAX_WINDOW, NgramIndex
from pagedllm.core.sequence import Sequence
from pagedllm.core.speculation_gate import MIN_PAIRS
from pagedllm.outputs import RequestMetrics

SPECULATE_ALWAYS = dict(num_speculative_tokens=4, speculative_disable_by_batch_size=256)


def repeating_prompts(n: int = 8, seed: int = 1) -> list[list[int]]:
    """Prompts that quote themselves (a phrase said several times), so that lookups find something to propose."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(100, 49152) for _ in range(rng.choice([2, 3, 5, 9]))]
        lead = [rng.randrange(100, 49152) for _ in range(rng.choice([1, 4, 7]))]
        prompts.append(lead + phrase * rng.choice([2, 3, 4]))
    return prompts


@pytest.fixture(scope="module")
def reference(hf_tiny):
    prompts = mixed_prompts(8) + repeating_prompts()
    return prompts, [hf_greedy(hf_tiny, p, MAX_TOKENS) for p in prompts]


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert index.propose(tokens, 2) == [7, 5]  # (1, 2, 3) last seen at 4..6; the final occurrence is not a match
    tokens.append(7)
    assert index.propose(tokens, 4) == [5, 1, 2, 3]  # (2, 3, 7), then the index grows with the sequence
    assert NgramIndex().propose([5, 6, 1, 5], 2) == [6, 1]  # no 3- or 2-gram match: the last token alone
    assert NgramIndex().propose([5, 6, 1, 7], 3) == [] and NgramIndex().propose([4], 3) == []
    assert NgramIndex().propose([8, 8, 8, 8], 3) == [8]  # what followed (8, 8, 8) at 0..2: one token is known


def test_proposals_grow_while_kept_whole_and_shrink_to_what_was_kept():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 6] * 4
    assert index.window == 1 and index.propose(tokens, min(4, index.window)) == [1]
    for proposed, accepted, window in [(1, 1, 2), (2, 2, 4), (4, 4, 8), (3, 1, 1), (1, 0, 1), (1, 1, 2), (2, 0, 1)]:
        index.record(proposed, accepted)
        assert index.window == window
    index.record(0, 0)  # nothing proposed: nothing learnt
    assert index.window == 1
    for _ in range(10):
        index.record(index.window, index.window)
    assert index.window == MAX_WINDOW


@pytest.mark.parametrize("floor", [0, 2, 4])
def test_a_step_proposes_within_each_sequence_window_or_the_gate_floor(tiny_model_dir, floor):
    """The scheduler asks each lookup for at most the larger of its window and the gate's floor for the batch size
    (here fixed), and never more than num_speculative_tokens; the engine tells each lookup what was kept. Tokens stay
    those of one-token steps (the test above)."""
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=128, num_speculative_tokens=4)
    engine = llm.engine
    engine.scheduler.gate.choose = lambda running: True
    engine.scheduler.gate.proposal_floor = lambda running, most: floor
    for i, prompt in enumerate(repeating_prompts(4, seed=11)):
        engine.add_request(str(i), prompt, greedy(24))
    seqs = [engine.groups[str(i)].seqs[0] for i in range(4)]
    beyond_windows = grew_any = False
    while engine.has_unfinished_requests():
        windows = [seq.lookup.window for seq in seqs]
        before = engine.num_draft_tokens, engine.num_accepted_tokens
        engine.step()
        drafted = engine.num_draft_tokens - before[0]
        assert drafted <= sum(min(4, max(w, floor)) for w in windows)
        beyond_windows |= drafted > sum(min(4, w) for w in windows)
        kept = engine.num_accepted_tokens - before[1]
        grew = sum(seq.lookup.window > w for w, seq in zip(windows, seqs))
        assert grew <= kept  # a window grows only when its whole proposal was kept
        grew_any |= grew > 0
    # every window starts at 1, so the first token kept was a whole proposal
    assert engine.num_accepted_tokens > 0 and grew_any
    assert not beyond_windows or floor > 0  # only a floor lets a step past the windows
    assert engine.block_manager.num_free_blocks == 128


def test_a_sequence_proposes_up_to_the_larger_of_its_window_and_the_floor(tiny_model_dir):
    scheduler = LLM(tiny_model_dir, dtype="float32", num_blocks=16, num_speculative_tokens=4).engine.scheduler
    seq = Sequence("r", None, [5, 6, 7, 8, 9, 10] * 3, SamplingParams(max_tokens=50), RequestMetrics(0.0),
                   max_tokens=50)
    proposed = []
    for window, floor in [(1, 0), (1, 3), (2, 0), (2, 1), (8, 0), (1, 9)]:
        seq.lookup.window, scheduler._proposal_floor = window, floor
        proposed.append(len(scheduler._draft(seq, budget=100)))
    assert proposed == [1, 3, 2, 2, 4, 4]  # never past num_speculative_tokens
    scheduler._proposal_floor = 4
    assert len(scheduler._draft(seq, budget=2)) == 2  # nor the step's budget
    seq.max_draft = 1  # nor what its grammar's mask budget leaves room for
    assert len(scheduler._draft(seq, budget=100)) == 1
    seq.max_draft = 0
    assert scheduler._draft(seq, budget=100) == []


@pytest.mark.parametrize("engine_args", [
    dict(block_size=16),
    dict(block_size=1),
    dict(block_size=16, max_num_batched_tokens=7),  # chunked prefill; the budget also cuts the drafts
    dict(num_blocks=12, block_size=8, max_num_batched_tokens=64),  # preemption drops drafts and recomputes
    dict(block_size=4, attention_backend="reference"),
], ids=["bs16", "bs1", "chunked", "preemption", "reference-attention"])
def test_greedy_tokens_match_transformers_with_speculation(tiny_model_dir, reference, engine_args):
    prompts, refs = reference
    engine_args = {"num_blocks": 512, **engine_args}
    llm = LLM(tiny_model_dir, dtype="float32", **SPECULATE_ALWAYS, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    engine = llm.engine
    for out, (ref, logits) in zip(outs, refs):
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == MAX_TOKENS
        assert_matches_reference(out.outputs[0].token_ids, ref, logits)
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens  # proposals were made, some held, some not
    assert engine.num_generated_tokens == MAX_TOKENS * len(prompts)
    assert engine.block_manager.num_free_blocks == engine_args["num_blocks"]
    engine.check_invariants()


def test_stops_and_lengths_are_those_of_one_token_steps(tiny_model_dir):
    """max_tokens, stop strings and EOS end a sequence inside a step's accepted tokens exactly where one-token steps
    end it; a seeded sampled request beside them gets the same tokens with drafts as without."""
    prompts = repeating_prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (1, 2, 5, 13)]
    params += [SamplingParams(temperature=0, max_tokens=40, stop=["a", " the"]),
               SamplingParams(temperature=0.9, seed=7, max_tokens=20)]
    runs = []
    for k in (0, 4):
        llm = LLM(tiny_model_dir, dtype="float32", num_blocks=256, num_speculative_tokens=k,
                  speculative_disable_by_batch_size=256)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        assert llm.engine.block_manager.num_free_blocks == 256
    assert llm.engine.num_accepted_tokens > 0
    for plain, speculative in zip(*runs):
        a, b = plain.outputs[0], speculative.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                          a.stop_reason)


def test_off_when_more_run_than_the_limit(tiny_model_dir):
    prompts = repeating_prompts(6, seed=5)
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=256, num_speculative_tokens=4,
              speculative_disable_by_batch_size=5)
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert llm.engine.num_draft_tokens == 0  # six ran together until all finished at once
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=256, **SPECULATE_ALWAYS)
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert llm.engine.num_draft_tokens > 0


def test_by_default_the_gate_decides_from_neighbouring_steps_and_tokens_stay_those_of_one_token_steps(tiny_model_dir):
    """Which way it settles depends on this machine's timings (the tiny model seldom repeats itself): not asserted."""
    prompts = repeating_prompts(6, seed=9)
    runs = []
    for k in (0, 4):
        llm = LLM(tiny_model_dir, dtype="float32", num_blocks=256, num_speculative_tokens=k)
        runs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   greedy(), use_tqdm=False)])
    assert runs[0] == runs[1]
    # six sequences ran together; accepted drafts may end some early (fewer running: another bucket)
    row = next(r for r in llm.engine.stats().spec_gate if r["running"] == "4-7")
    assert row["comparisons"] >= MIN_PAIRS and row["drafts"] in (True, False)
    assert llm.engine.block_manager.num_free_blocks == 256


class TopCandidates:
    """Transformers' fp32 view of the tiny model after a prompt: each continuation's kept tokens and their
    probabilities under top-k 3 (then top-p), and the greedy tokens after it, computed once per prefix."""

    def __init__(self, model, prompt: list[int], params: SamplingParams) -> None:
        self.model, self.prompt, self.params = model, prompt, params
        self.cache: dict[tuple[int, ...], dict[int, float]] = {}

    def kept(self, outputs: tuple[int, ...]) -> dict[int, float]:
        if outputs not in self.cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([self.prompt + list(outputs)])).logits[0, -1].double()
            values, ids = (logits / self.params.temperature).topk(3)
            probs = values.softmax(-1)  # descending; vLLM's top-p drops the low tail of share <= 1 - p
            at_and_below = probs.flip(0).cumsum(0).flip(0)
            keep = (at_and_below > 1 - self.params.top_p) | (torch.arange(3) == 0)
            probs = torch.where(keep, probs, 0.0)
            self.cache[outputs] = dict(zip(ids.tolist(), (probs / probs.sum()).tolist()))
        return self.cache[outputs]

    def greedy(self, outputs: tuple[int, ...], n: int) -> list[int]:
        tokens = list(outputs)
        for _ in range(n):
            kept = self.kept(tuple(tokens))
            tokens.append(max(kept, key=kept.get))
        return tokens[len(outputs):]

    def probability(self, outputs: tuple[int, ...]) -> float:
        p = 1.0
        for i, token in enumerate(outputs):
            p *= self.kept(outputs[:i]).get(token, 0.0)
        return p


def chi_square_p_value(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float]) -> float:
    """Pearson's test of the observed continuations against their exact probabilities (cells expecting fewer than 5
    pooled into one; a continuation outside `expected` alone fails it)."""
    n = sum(counts.values())
    assert set(counts) <= set(expected), set(counts) - set(expected)
    cells, pooled = [], [0, 0.0]
    for seq, p in expected.items():
        observed, want = counts.get(seq, 0), n * p
        if want < 5:
            pooled[0] += observed
            pooled[1] += want
        else:
            cells.append((observed, want))
    if pooled[1] > 0:
        cells.append(tuple(pooled))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params, seeded", [
    (SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True), False),
    (SamplingParams(temperature=0.6, top_k=3, top_p=0.8, max_tokens=4, ignore_eos=True), False),
    (SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True), True),
], ids=["top-k", "top-k-top-p", "seeded"])
def test_sampled_tokens_follow_the_distribution_of_one_token_steps(tiny_model_dir, hf_tiny, params, seeded):
    """A sampled decode verifies proposals (here transformers' greedy tokens, which the model often keeps) and its
    four tokens follow the exact joint distribution of one-token steps, computed with transformers: 1,024 samples
    (seeded: seeds 0-1023, each drawing its positions from its own stream) against it by Pearson's test. Keeping a
    proposal whenever it is allowed, or taking the pick of the wrong row, fails it."""
    prompt = repeating_prompts(1, seed=13)[0]
    exact = TopCandidates(hf_tiny, prompt, params)
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=512, num_speculative_tokens=3, seed=5)
    scheduler = llm.engine.scheduler
    scheduler.gate.choose = lambda running: True
    scheduler._draft = lambda seq, budget: exact.greedy(tuple(seq.output_token_ids),
                                                         min(3, budget, seq.max_tokens - seq.num_output_tokens - 1))
    counts: dict[tuple[int, ...], int] = {}
    for batch in range(16):
        batch_params = [replace(params, seed=64 * batch + i) for i in range(64)] if seeded else params
        for out in llm.generate([{"prompt_token_ids": prompt}] * 64, batch_params, use_tqdm=False):
            tokens = tuple(out.outputs[0].token_ids)
            counts[tokens] = counts.get(tokens, 0) + 1
    engine = llm.engine
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens  # proposals were made, some held, some not
    expected = {tokens: exact.probability(tokens) for tokens in _continuations(exact, (), 4)}
    assert abs(sum(expected.values()) - 1) < 1e-9
    assert chi_square_p_value(counts, expected) > 1e-3
    assert engine.block_manager.num_free_blocks == 512


def _continuations(exact: TopCandidates, outputs: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    if n == 0:
        return [()]
    return [(t, *rest) for t in exact.kept(outputs) for rest in _continuations(exact, (*outputs, t), n - 1)
            if exact.kept(outputs)[t] > 0]


def test_a_seeded_request_gets_the_tokens_of_one_token_steps_whatever_the_drafts(tiny_model_dir, hf_tiny):
    """A seeded row draws each output position from a stream of its own, so verifying proposals (transformers'
    greedy tokens, often kept) gives a seeded request exactly the tokens it gets without them, in a batch or alone,
    and so does preemption."""
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=12, ignore_eos=True, seed=seed) for seed in range(24)]
    prompt = repeating_prompts(1, seed=13)[0]
    exact = TopCandidates(hf_tiny, prompt, params[0])
    runs, engines = [], []
    for k, engine_args in [(0, {}), (3, {}), (3, dict(num_blocks=40, block_size=4, max_num_batched_tokens=64))]:
        llm = LLM(tiny_model_dir, dtype="float32", **{"num_blocks": 512, **engine_args}, num_speculative_tokens=k)
        scheduler = llm.engine.scheduler
        scheduler.gate.choose = lambda running: True
        scheduler._draft = lambda seq, budget: exact.greedy(
            tuple(seq.output_token_ids), min(3, budget, seq.max_tokens - seq.num_output_tokens - 1))
        outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
        runs.append([out.outputs[0].token_ids for out in outs])
        engines.append(llm.engine)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.pool.num_blocks
    plain, drafted, preempted = engines
    assert plain.num_draft_tokens == 0 and 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens
    assert preempted.scheduler.num_preemptions > 0
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(tokens) for tokens in runs[0]}) > 12  # the seeds drew different continuations
    alone = LLM(tiny_model_dir, dtype="float32", num_blocks=512, num_speculative_tokens=0)
    assert alone.generate([{"prompt_token_ids": prompt}], params[5], use_tqdm=False)[0].outputs[0].token_ids \
        == runs[0][5]


def test_rows_that_read_the_outputs_get_the_tokens_and_logprobs_of_one_token_steps(tiny_model_dir, hf_tiny):
    """Logprobs, penalties, min_tokens bans and parallel samples verify proposals too: each of a draft's rows sees the
    outputs before it, proposed tokens included, and reports its own logprobs. With transformers' greedy tokens as
    proposals (often kept), every request gets exactly the tokens, and the logprobs, it gets in one-token steps."""
    prompt = repeating_prompts(1, seed=13)[0]
    exact = TopCandidates(hf_tiny, prompt, SamplingParams(temperature=1.0, top_k=3))
    # A stop token that greedy steps pick at position j >= 6 and not before: min_tokens 6 bans it on the rows before
    # position 6 only, so a draft row at 6 or 7 whose ban counted its sequence's outputs alone would move the stop.
    tokens = exact.greedy((), 14)
    j = next(j for j in range(6, 14) if tokens[j] not in tokens[:j])
    likely = tokens[j]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, presence_penalty=0.6,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=14, min_tokens=6, stop_token_ids=[likely]),
              SamplingParams(temperature=1.0, top_k=3, max_tokens=14, ignore_eos=True, n=3, seed=2, logprobs=1),
              SamplingParams(temperature=1.0, top_k=3, max_tokens=14, ignore_eos=True, seed=4,
                             frequency_penalty=0.5)]
    runs, engines = [], []
    for k in (0, 3):
        llm = LLM(tiny_model_dir, dtype="float32", num_blocks=512, num_speculative_tokens=k)
        scheduler = llm.engine.scheduler
        scheduler.gate.choose = lambda running: True
        scheduler._draft = lambda seq, budget: exact.greedy(
            tuple(seq.output_token_ids), min(3, budget, seq.max_tokens - seq.num_output_tokens - 1))
        runs.append(llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False))
        engines.append(llm.engine)
        assert llm.engine.block_manager.num_free_blocks == 512
    assert engines[0].num_draft_tokens == 0 and 0 < engines[1].num_accepted_tokens < engines[1].num_draft_tokens
    for plain, drafted in zip(*runs):
        assert len(plain.outputs) == len(drafted.outputs)
        for a, b in zip(plain.outputs, drafted.outputs):
            assert (b.token_ids, b.finish_reason, b.stop_reason) == (a.token_ids, a.finish_reason, a.stop_reason)
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x.keys() == y.keys()
                assert [v.logprob for v in y.values()] == pytest.approx([v.logprob for v in x.values()], abs=1e-4)
    assert runs[0][3].outputs[0].stop_reason == likely and len(runs[0][3].outputs[0].token_ids) == j + 1
    assert len({tuple(o.token_ids) for o in runs[0][4].outputs}) == 3


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24),
    SamplingParams(temperature=1.0, top_k=5, max_tokens=24, seed=3),
], ids=["greedy", "seeded"])
def test_under_a_grammar_each_of_a_drafts_rows_gets_the_mask_after_the_proposals(tiny_model_dir, params):
    """Proposals that are the tokens one-token steps gave (kept), with every third one a token the grammar refuses
    (never kept: the row before it masks it, and the rows after repeat that mask), leave every request the tokens
    it gets without drafts, within its grammar."""
    regex = "[a-z ]{5,40}"
    grammar = replace(params, structured_outputs=StructuredOutputsParams(regex=regex))
    prompts = repeating_prompts(4, seed=21)
    reference = [o.outputs[0] for o in LLM(tiny_model_dir, dtype="float32", num_blocks=256).generate(
        [{"prompt_token_ids": p} for p in prompts], grammar, use_tqdm=False)]
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=256, num_speculative_tokens=3)
    refused = llm.get_tokenizer().encode("7", add_special_tokens=False)[0]
    scheduler = llm.engine.scheduler
    scheduler.gate.choose = lambda running: True

    def propose(seq, budget):
        start, room = seq.num_output_tokens, min(3, budget, seq.max_tokens - seq.num_output_tokens - 1)
        tokens = reference[int(seq.request_id)].token_ids[start:start + room]
        return [refused if (start + i) % 3 == 2 else t for i, t in enumerate(tokens)]

    scheduler._draft = propose
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, grammar)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
    for i, ref in enumerate(reference):
        out = outputs[str(i)]
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        assert re.fullmatch(regex, out.text) or (out.finish_reason == "length" and re.fullmatch("[a-z ]*", out.text))
    assert engine.block_manager.num_free_blocks == 256
