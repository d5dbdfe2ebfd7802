"""Where and at what cost the grammar mask is filled: on the mask thread while the model's forward runs (the sampler
waits for it, the forward does not), and each request charged its rows' CPU time, so that a grammar whose mask costs
more than MAX_MASK_MS_PER_STEP fails its own request while the others keep their steps."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.core.sequence import Sequence
from pagedllm.engine.grammar_limits import MASK_BUDGET_STEPS, MAX_MASK_MS_PER_STEP, check_mask_cost
from pagedllm.engine.output_processor import PendingFill
from pagedllm.engine.structured_output import MAX_DRAFT_ROOM, GrammarBrokenError, MaskBudget
from pagedllm.errors import InvalidRequestError
from pagedllm.model.sampler import GrammarMask
from pagedllm.outputs import RequestMetrics

DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", num_blocks=512, threads=1)


@pytest.fixture
def engine(llm: LLM):
    """The module's engine, its mask budget restored after each test."""
    budget = llm.engine.output_processor.mask_budget
    yield llm.engine
    llm.engine.output_processor.mask_budget = budget


def run_all(engine) -> tuple[dict, dict]:
    """Step until every request is done: the last output and the error (if any) of each request."""
    outputs, failed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        failed.update(engine.pop_failed_requests())
    return outputs, failed


def test_grammar_mask_reads_a_pending_fill_when_asked():
    bitmask = torch.tensor([[5, -1]], dtype=torch.int32)
    future: Future[torch.Tensor] = Future()
    mask = GrammarMask(torch.tensor([0]), future)
    threading.Timer(0.05, future.set_result, [bitmask]).start()
    assert mask.bitmask is bitmask  # waited for the fill
    assert GrammarMask(torch.tensor([0]), bitmask).bitmask is bitmask


def test_the_mask_fills_while_the_forward_runs(engine, monkeypatch):
    """The fill waits until the forward has started: a fill made before the forward (as the engine used to) would
    wait out its timeout and this test would see `forward_started` unset when the fill ended."""
    forward_started = threading.Event()
    seen: dict[str, object] = {}
    real_forward, real_fill = engine.runner.model.forward, engine.structured.fill_bitmask

    def forward(*args, **kwargs):
        forward_started.set()
        return real_forward(*args, **kwargs)

    def fill(matchers, costs=None, drafts=None):
        seen["overlapped"] = forward_started.wait(timeout=30)
        seen["thread"] = threading.current_thread()
        return real_fill(matchers, costs, drafts)

    monkeypatch.setattr(engine.runner.model, "forward", forward)
    monkeypatch.setattr(engine.structured, "fill_bitmask", fill)
    spec = StructuredOutputsParams(regex=DATE)
    engine.add_request("date", "Today is", SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec))
    outputs, failed = run_all(engine)
    assert not failed
    assert seen["overlapped"] is True
    assert seen["thread"] is not threading.current_thread()
    text = outputs["date"].outputs[0].text
    assert outputs["date"].outputs[0].finish_reason == "stop" and len(text) == 10 and text[4] == "-", text


def test_a_grammar_over_the_mask_budget_fails_alone(engine):
    """A zero budget: every grammar's mask costs more, so the structured request fails after MASK_BUDGET_STEPS
    steps with an error naming the limit; the plain request of the same steps finishes as usual."""
    engine.output_processor.mask_budget = MaskBudget(limit_ms=0.0, steps=3)
    spec = StructuredOutputsParams(regex="a{1000}")
    engine.add_request("heavy", "Write", SamplingParams(n=4, temperature=0, max_tokens=50, structured_outputs=spec))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outputs, failed = run_all(engine)
    assert set(failed) == {"heavy"}
    assert isinstance(failed["heavy"], GrammarBrokenError)
    assert "over the limit of 0 ms" in str(failed["heavy"]) and "fewer samples" in str(failed["heavy"])
    assert all(c.finish_reason == "abort" and len(c.token_ids) < 50 for c in outputs["heavy"].outputs)
    assert outputs["plain"].outputs[0].finish_reason == "length"
    assert len(outputs["plain"].outputs[0].token_ids) == 12


def test_a_grammar_within_the_budget_is_untouched(engine):
    engine.output_processor.mask_budget = MaskBudget(limit_ms=1e6)
    spec = StructuredOutputsParams(regex="a{30}")
    engine.add_request("ok", "Write", SamplingParams(n=3, temperature=0, max_tokens=40, structured_outputs=spec))
    outputs, failed = run_all(engine)
    assert not failed
    assert [c.text for c in outputs["ok"].outputs] == ["a" * 30] * 3


def test_mask_budget_averages_the_last_steps():
    budget = MaskBudget(limit_ms=10.0, steps=4)
    for _ in range(3):  # not enough steps to judge yet, however costly
        assert budget.charge({"slow": 1.0, "fast": 0.001}) == {}
    over = budget.charge({"slow": 1.0, "fast": 0.001})
    assert set(over) == {"slow"} and "over the limit of 10 ms" in str(over["slow"])
    # one costly step among cheap ones stays under the average
    spiky = MaskBudget(limit_ms=10.0, steps=4)
    assert all(not spiky.charge({"r": s}) for s in (0.001, 0.001, 0.030, 0.001, 0.001))
    spiky.keep_only(set())
    assert len(spiky) == 0


def test_the_default_budget():
    """n=32 samples of a{5000} (~1.1 ms a row here) cost ~35 ms a step: over; a typical schema's rows (~50 us)
    are far under."""
    assert 32 * 0.05 < MAX_MASK_MS_PER_STEP < 32 * 1.1
    assert MASK_BUDGET_STEPS >= 4


def test_samples_whose_mask_is_over_the_budget_from_the_start_are_refused(engine):
    """The compile measures a mask row in the grammar's start state; n samples of it over the budget are a 400
    before a step is spent, fewer samples of the same grammar are accepted."""
    spec = StructuredOutputsParams(regex="a{5000}")
    row_s = engine.compile_grammar(spec).mask_s
    assert row_s > 0
    too_many = int(MAX_MASK_MS_PER_STEP / 1e3 / row_s) + 1
    with pytest.raises(InvalidRequestError, match=r"samples would cost .* over the limit of 10 ms"):
        engine.add_request("many", "Write", SamplingParams(n=too_many, max_tokens=4, structured_outputs=spec))
    assert not engine.has_unfinished_requests()
    row_s = MAX_MASK_MS_PER_STEP / 1e3 * 0.4
    check_mask_cost(row_s, 2)  # 80% of the limit: accepted
    with pytest.raises(InvalidRequestError, match="3 samples"):
        check_mask_cost(row_s, 3)


def test_a_drafts_rows_get_the_masks_after_its_tokens_and_the_matcher_goes_back(engine):
    """Row i of a draft is the mask after its first i tokens; rows past a token the grammar refuses, or an id past
    the vocabulary, repeat the last mask; the matcher ends where it was, not in error."""
    manager = engine.structured
    matcher = manager.new_matchers(StructuredOutputsParams(regex="[a-z ]{5,40}"), 1)[0]
    tokenizer = engine.tokenizer
    good = tokenizer.encode("hello world", add_special_tokens=False)
    refused = tokenizer.encode("7", add_special_tokens=False)[0]
    before = manager.fill_bitmask([matcher])[0]
    after = []
    for i in range(1, len(good) + 1):
        copy = matcher.deep_copy()
        assert copy.consume_tokens(good[:i])
        after.append(manager.fill_bitmask([copy])[0])
    rows = manager.fill_bitmask([matcher], drafts=[[*good, refused, good[0]]])
    assert rows.shape[0] == len(good) + 3 and torch.equal(rows[0], before)
    for i, mask in enumerate(after):
        assert torch.equal(rows[1 + i], mask)
    assert torch.equal(rows[-1], after[-1]) and torch.equal(rows[-2], after[-1])
    rows = manager.fill_bitmask([matcher], drafts=[[good[0], engine.model_config.vocab_size + 5, good[1]]])
    assert torch.equal(rows[1], after[0]) and torch.equal(rows[2], after[0]) and torch.equal(rows[3], after[0])
    assert not matcher.is_error() and torch.equal(manager.fill_bitmask([matcher])[0], before)


def test_a_requests_mask_budget_caps_its_samples_next_proposals(engine):
    """After each fill, a constrained sequence may propose as many tokens as keep its request's rows (first rows'
    cost x (1 + proposals)) within the mask budget; a cheap grammar is not capped."""
    processor = engine.output_processor

    def seq(request_id: str) -> Sequence:
        return Sequence(request_id, None, [5, 6], SamplingParams(max_tokens=50), RequestMetrics(0.0), max_tokens=50)

    heavy, heavy_too, light = seq("heavy"), seq("heavy"), seq("light")
    future: Future[torch.Tensor] = Future()
    future.set_result(torch.zeros((3, 1), dtype=torch.int32))
    limit = processor.mask_budget.limit_s
    processor._filling = PendingFill([heavy, heavy_too, light], [0.25 * limit, 0.25 * limit, 0.125 * limit], future)
    processor.finish_fill()
    assert heavy.max_draft == heavy_too.max_draft == 1  # two samples at a quarter of the limit: 2 x (1 + 1) rows
    assert light.max_draft == 7
    assert processor.mask_budget.draft_room(0.0) == MAX_DRAFT_ROOM
    assert not processor._over_budget
