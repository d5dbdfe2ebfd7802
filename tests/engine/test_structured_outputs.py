"""Structured outputs offline, on the tiny random model: whatever a random model wants to write, the grammar mask
makes every output parse (JSON schema, regex, choice, grammar), with n > 1, under preemption, next to unconstrained
requests in the same steps; bad grammars are refused before the scheduler."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.structured_output import close_objects
from pagedllm.errors import InvalidRequestError
from pagedllm.model.sampler import GrammarMask, SamplingBatch, sample

# Bounded strings and integers: a random model otherwise writes until max_tokens (valid so far, never finished).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "color", "tags", "address"],
}
DATE = r"\d{4}-\d{2}-\d{2}"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PROMPTS = ["Hello", "Tell me about yourself.", "The weather today is", "1 2 3"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", num_blocks=512, threads=1)  # one thread: steady on a busy machine


def generate(llm: LLM, spec: StructuredOutputsParams, n: int = 1, temperature: float = 0.8,
             max_tokens: int = 200, prompts: list[str] = PROMPTS) -> list:
    params = [SamplingParams(n=n, temperature=temperature, seed=i, max_tokens=max_tokens, structured_outputs=spec)
              for i in range(len(prompts))]
    return [c for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


def test_json_schema_outputs_always_validate(llm):
    outputs = generate(llm, StructuredOutputsParams(json=PERSON), n=3)
    assert len(outputs) == 12
    for c in outputs:
        assert c.finish_reason == "stop", c.text
        obj = json.loads(c.text)
        jsonschema.validate(obj, close_objects(PERSON))
        assert set(obj) == set(PERSON["properties"])  # extra keys are closed off by default
    assert len({c.text for c in outputs}) > 1  # the samples differ: each has its own matcher


def test_json_object_and_schema_given_as_text(llm):
    for c in generate(llm, StructuredOutputsParams(json=json.dumps(PERSON))):
        jsonschema.validate(json.loads(c.text), PERSON)
    # Any object: a random model may write one without end, so check what a finished one is
    for c in generate(llm, StructuredOutputsParams(json_object=True), max_tokens=64):
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


@pytest.mark.parametrize("pattern", [DATE, PHONE])
def test_regex_always_matches(llm, pattern):
    for c in generate(llm, StructuredOutputsParams(regex=pattern), n=4):
        assert c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), c.text
        assert c.text.isascii()  # \d is [0-9], not any Unicode digit


def test_choice_returns_only_the_labels(llm):
    labels = ["positive", "negative", "neutral"]
    outputs = generate(llm, StructuredOutputsParams(choice=labels), n=5)
    assert {c.text for c in outputs} <= set(labels)
    assert all(c.finish_reason == "stop" for c in outputs)


@pytest.mark.parametrize("grammar", ['root ::= "yes" | "no" | [0-9] [0-9]?',  # GBNF
                                     'start: ("yes" | "no" | /[0-9]{1,2}/)'])  # Lark
def test_grammar(llm, grammar):
    for c in generate(llm, StructuredOutputsParams(grammar=grammar), n=3):
        assert c.text in ("yes", "no") or (c.text.isdigit() and len(c.text) <= 2), c.text


def test_greedy_ignore_eos_and_logprobs(llm):
    """Greedy takes the full sampling path when a row is constrained; a finished grammar ends the sequence even
    with ignore_eos; logprobs are those after the mask (the only allowed token has logprob 0)."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=2,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for o in out:
        c = o.outputs[0]
        assert c.text in ("alpha", "beta") and c.finish_reason == "stop"
        assert c.logprobs[-1][c.token_ids[-1]].logprob == pytest.approx(0.0, abs=1e-5)  # forced last token
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in again]


def test_unconstrained_requests_in_the_same_steps_are_untouched(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    mixed_params = [greedy, SamplingParams(temperature=0.8, seed=1, max_tokens=100,
                                           structured_outputs=StructuredOutputsParams(json=PERSON))] * len(PROMPTS)
    mixed = llm.generate([p for p in PROMPTS for _ in range(2)], mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone
    for o in mixed[1::2]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_preemption_keeps_the_grammar_state(tiny_model_dir, llm):
    """A recomputed sequence keeps its output tokens, so its matcher stays valid: same outputs as without
    preemption, all valid."""
    spec = StructuredOutputsParams(json=PERSON)
    params = [SamplingParams(n=2, temperature=0.8, seed=i, max_tokens=100, structured_outputs=spec) for i in range(4)]
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS[:2]]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    # 15 blocks of 8 per sample (prompt + 100 tokens fit), 8 samples: they cannot all run at once
    tight = LLM(tiny_model_dir, dtype="float32", num_blocks=30, block_size=8, max_num_batched_tokens=64,
                threads=1)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().preemptions > 0
    assert [c.text for o in squeezed for c in o.outputs] == [c.text for o in roomy for c in o.outputs]
    finished = [c for o in squeezed for c in o.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 6  # of 8
    for c in finished:  # a sample cut at max_tokens (a random model may pad its JSON with whitespace) is a prefix
        jsonschema.validate(json.loads(c.text), PERSON)
    tight.engine.check_invariants()
    assert tight.engine.stats().blocks_in_use == 0


def test_chat_with_structured_outputs(llm):
    out = llm.chat([{"role": "user", "content": "Pick a date."}],
                   SamplingParams(temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(regex=DATE)),
                   use_tqdm=False)
    assert re.fullmatch(DATE, out[0].outputs[0].text)


@pytest.mark.parametrize("spec,message", [
    (dict(json={"type": "objectx"}), "Invalid type"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"type": "string", "format": "no-such-format"}), "Unknown format"),
    (dict(regex="(abc"), "unclosed group"),
    (dict(grammar="start: undefined_rule"), "unknown name"),
])
def test_bad_grammars_are_refused_and_the_engine_keeps_serving(llm, spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(["Hello"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert generate(llm, StructuredOutputsParams(choice=["ok"]))[0].text == "ok"


@pytest.mark.parametrize("fields,message", [
    (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"), (dict(choice=[]), "non-empty"),
    (dict(json=3), "JSON schema"),
])
def test_bad_structured_outputs_params(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutputsParams(**fields)


def test_compiled_grammars_are_cached_by_text(llm):
    engine = llm.engine
    first = engine.compile_grammar(StructuredOutputsParams(json={**PERSON, "title": "cache-test"}))
    assert engine.compile_grammar(StructuredOutputsParams(json={**PERSON, "title": "cache-test"})) is first
    assert engine.compile_grammar(StructuredOutputsParams(json={**PERSON, "title": "other"})) is not first


def test_close_objects_walks_subschemas_only():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a key named "properties"
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "items": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
        "c": {"const": {"properties": {"z": 1}}},
    }, "$defs": {"D": {"type": "object", "properties": {"w": {}}}}}
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and "additionalProperties" not in props
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["c"] == {"const": {"properties": {"z": 1}}}
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not modified


def test_sampler_masks_only_the_constrained_rows():
    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(3, vocab)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[0, 70 // 32] = 1 << (70 % 32)  # row 1 may only write token 70
    params = [SamplingParams(temperature=0)] * 3
    batch = SamplingBatch.build(params, [[1]] * 3, [[]] * 3, [None] * 3, vocab,
                                grammar=GrammarMask(torch.tensor([1]), bitmask))
    assert batch.is_plain_greedy  # greedy under a grammar keeps the fast path (tests/model/test_layers.py)
    out = sample(logits.clone(), batch)
    assert out.token_ids.tolist() == [int(logits[0].argmax()), 70, int(logits[2].argmax())]
    assert out.logprobs[1] == pytest.approx(0.0)
