"""Benchmark workloads: deterministic by seed, the intended length distributions, real text whose ids are its own
encoding, every request fitting the context, each dataset's own fields, JSONL files, Poisson arrivals."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from pagedllm.bench.datasets import (
    DATASETS,
    BenchRequest,
    describe,
    poisson_arrivals,
    sample_requests,
    save_workload,
    synthetic_requests,
)
from pagedllm.model.tokenizer import Tokenizer

GENERATED = [d for d in DATASETS if d != "file"]
TEXT = ["sharegpt", "alpaca", "shared-prefix", "parallel-sampling", "beam-search"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def bos_tok(tiny_model_dir, tmp_path_factory) -> Tokenizer:
    """The same vocabulary, but BOS added to every encoding (as Llama models do)."""
    path = tmp_path_factory.mktemp("bos-tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model_dir, f), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tokenizer = Tokenizer.from_dir(str(path))
    assert tokenizer.add_bos
    return tokenizer


def lengths(requests: list[BenchRequest]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([len(r.prompt_token_ids) for r in requests]), np.array([r.output_len for r in requests])


@pytest.mark.parametrize("dataset", GENERATED)
def test_the_seed_decides_the_workload(tok, dataset):
    first = sample_requests(dataset, tok, 20, seed=3)
    assert len(first) == 20 and all(isinstance(r, BenchRequest) for r in first)
    assert sample_requests(dataset, tok, 20, seed=3) == first
    assert sample_requests(dataset, tok, 20, seed=4) != first


@pytest.mark.parametrize("dataset, means", [("sharegpt", (160, 125)), ("alpaca", (19, 58))])
def test_length_distributions(tok, dataset, means):
    requests = sample_requests(dataset, tok, 300, seed=0)
    inputs, outputs = lengths(requests)
    # Sample means are rescaled to the targets; a cut prompt can come out a token short of its drawn length.
    assert means[0] * 0.97 <= inputs.mean() <= means[0] + 0.5
    assert abs(outputs.mean() - means[1]) <= 0.5
    assert inputs.min() >= 3 and outputs.min() >= 4
    stats = describe(requests)
    assert stats["input_len"]["mean"] == round(float(inputs.mean()), 1)
    assert stats["output_len"]["median"] < stats["output_len"]["mean"] < stats["output_len"]["p90"]  # right tail
    assert stats["output_len"]["max"] == outputs.max()


def test_sharegpt_has_a_longer_tail_than_alpaca(tok):
    spread = {}
    for dataset in ("sharegpt", "alpaca"):
        stats = describe(sample_requests(dataset, tok, 300, seed=1))["input_len"]
        spread[dataset] = stats["p90"] / stats["median"]
    assert spread["sharegpt"] > spread["alpaca"] * 1.3


def test_lengths_can_be_overridden(tok):
    inputs, outputs = lengths(sample_requests("sharegpt", tok, 200, seed=0, input_len=40, output_len=10))
    assert 38 <= inputs.mean() <= 40.5 and abs(outputs.mean() - 10) <= 0.5
    inputs, outputs = lengths(sample_requests("random", tok, 10, seed=0, input_len=12, output_len=5))
    assert set(inputs) == {12} and set(outputs) == {5}


@pytest.mark.parametrize("dataset", GENERATED)
def test_requests_fit_max_model_len(tok, dataset):
    requests = sample_requests(dataset, tok, 100, seed=0, max_model_len=96, input_len=80, output_len=60)
    inputs, outputs = lengths(requests)
    assert (inputs < 96).all() and (outputs >= 1).all() and (inputs + outputs <= 96).all()
    assert (inputs + outputs == 96).any()  # outputs were clipped, not dropped
    for r in requests:
        assert tok.decode(r.prompt_token_ids) == r.prompt


@pytest.mark.parametrize("dataset", TEXT)
def test_text_prompts_are_their_own_encoding(tok, dataset):
    for r in sample_requests(dataset, tok, 50, seed=0):
        assert r.prompt.strip() and tok.encode(r.prompt) == r.prompt_token_ids
        assert tok.decode(r.prompt_token_ids) == r.prompt


def test_prompts_with_bos_keep_their_length(bos_tok):
    requests = sample_requests("sharegpt", bos_tok, 50, seed=0, input_len=30)
    for r in requests:
        assert r.prompt_token_ids[0] == bos_tok.bos_token_id and bos_tok.encode(r.prompt) == r.prompt_token_ids
    assert 29 <= lengths(requests)[0].mean() <= 30.5


def test_random_dataset_is_synthetic_requests(tok):
    requests = sample_requests("random", tok, 8, seed=5, input_len=20, output_len=6, range_ratio=0.5)
    pairs = synthetic_requests(8, 20, 6, 0.5, tok.vocab_size, 5)
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == pairs
    assert all(tok.decode(r.prompt_token_ids) == r.prompt for r in requests)
    assert all(1000 <= t < tok.vocab_size for r in requests for t in r.prompt_token_ids)


def test_each_dataset_sets_its_fields(tok):
    for dataset in ("random", "sharegpt", "alpaca", "shared-prefix"):
        assert all((r.n, r.beam_width) == (1, 0) for r in sample_requests(dataset, tok, 10, seed=0, n=3))
    parallel = sample_requests("parallel-sampling", tok, 10, seed=0, n=3)
    assert all((r.n, r.beam_width) == (3, 0) for r in parallel)
    assert [r.prompt for r in parallel] == [r.prompt for r in sample_requests("alpaca", tok, 10, seed=0)]
    beams = sample_requests("beam-search", tok, 10, seed=0, beam_width=5, output_len=12)
    assert all((r.n, r.beam_width, r.output_len) == (1, 5, 12) for r in beams)


def test_shared_prefix_requests_share_their_prefix(tok):
    requests = sample_requests("shared-prefix", tok, 30, seed=2, prefix_len=120)
    prompts = [r.prompt for r in requests]
    prefix = os.path.commonprefix(prompts)
    assert prefix.startswith("Name the Python standard library") and prefix.endswith("Description: ")
    assert len(set(prompts)) == 30  # a distinct question each
    shared_ids = os.path.commonprefix([r.prompt_token_ids for r in requests])
    assert 120 <= len(shared_ids) <= 160
    assert all(p[len(prefix):].count("Description:") == 0 for p in prompts)  # one question, no example after it


def write_lines(path, lines: list) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_jsonl_of_prompts(tok, tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", [
        {"prompt": "Tell me about the sea.", "output_len": 7}, "",
        {"prompt": "Write a poem about trees.", "max_tokens": 9},
        {"prompt": "What is paging?"}])
    requests = sample_requests("file", tok, 3, seed=0, dataset_path=path, output_len=11)
    assert sorted((r.prompt, r.output_len) for r in requests) == [
        ("Tell me about the sea.", 7), ("What is paging?", 11), ("Write a poem about trees.", 9)]
    assert all(tok.encode(r.prompt) == r.prompt_token_ids for r in requests)
    default = sample_requests("file", tok, 3, seed=0, dataset_path=path)
    assert {r.output_len for r in default if r.prompt == "What is paging?"} == {128}
    # The seed shuffles; more prompts than lines cycle through them; fewer take the first of the shuffle.
    orders = {tuple(r.prompt for r in sample_requests("file", tok, 3, seed=s, dataset_path=path)) for s in range(10)}
    assert len(orders) > 1
    cycled = sample_requests("file", tok, 7, seed=1, dataset_path=path)
    assert [r.prompt for r in cycled] == [r.prompt for r in cycled[:3]] * 2 + [cycled[0].prompt]
    assert len(sample_requests("file", tok, 2, seed=1, dataset_path=path)) == 2


def test_sharegpt_conversations(tok, tmp_path):
    reply = "Paging splits the cache into fixed-size blocks, so memory is taken only when it is needed."
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is paged attention?"},
                                      {"from": "gpt", "value": reply}, {"from": "human", "value": "Thanks"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Is anyone there?"}]},  # unanswered: skipped
        {"id": "c", "conversations": [{"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Hi!"},
                                      {"from": "gpt", "value": "How can I help?"}]},
    ]
    jsonl = write_lines(tmp_path / "sharegpt.jsonl", conversations)
    array = tmp_path / "sharegpt.json"
    array.write_text(json.dumps(conversations, indent=1))
    for path in (jsonl, str(array)):
        requests = sample_requests("file", tok, 2, seed=0, dataset_path=path)
        assert sorted((r.prompt, r.output_len) for r in requests) == sorted([
            ("What is paged attention?", len(tok.encode(reply, add_special_tokens=False))),
            ("Hi!", len(tok.encode("How can I help?", add_special_tokens=False)))])
    clipped = sample_requests("file", tok, 2, seed=0, dataset_path=jsonl, max_model_len=10)
    assert all(len(r.prompt_token_ids) + r.output_len <= 10 for r in clipped)


def test_saved_workload_replays_the_same_requests(tok, tmp_path):
    """--save-workload's JSONL of token ids reads back as the same requests, in the same order, whatever the seed."""
    original = sample_requests("sharegpt", tok, 12, seed=3)
    path = str(tmp_path / "workload.jsonl")
    save_workload(original, path)
    for seed in (0, 5):
        replayed = sample_requests("file", tok, 12, seed=seed, dataset_path=path)
        assert [(r.prompt_token_ids, r.output_len) for r in replayed] == [
            (r.prompt_token_ids, r.output_len) for r in original]
    with pytest.raises(ValueError, match="list of token ids"):
        save_path = write_lines(tmp_path / "bad_ids.jsonl", [{"prompt_token_ids": [1, "x"], "output_len": 3}])
        sample_requests("file", tok, 1, dataset_path=save_path)


def test_file_errors(tok, tmp_path):
    def sample(lines, **kwargs):
        return sample_requests("file", tok, 2, dataset_path=write_lines(tmp_path / "bad.jsonl", lines), **kwargs)

    with pytest.raises(ValueError, match="dataset path"):
        sample_requests("file", tok, 2)
    with pytest.raises(ValueError, match="cannot read"):
        sample_requests("file", tok, 2, dataset_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        sample([{"prompt": "ok"}, "{not json"])
    with pytest.raises(ValueError, match='line 1: expected a "prompt", "prompt_token_ids" or "conversations" key'):
        sample([{"text": "hello"}])
    with pytest.raises(ValueError, match="expected a JSON object"):
        sample([["a list"]])
    with pytest.raises(ValueError, match="non-empty string"):
        sample([{"prompt": ""}])
    with pytest.raises(ValueError, match="positive integer"):
        sample([{"prompt": "hi", "output_len": 0}])
    with pytest.raises(ValueError, match="holds no request"):
        sample([""])
    with pytest.raises(ValueError, match="no usable request"):
        sample([{"conversations": [{"from": "human", "value": "unanswered"}]}])
    with pytest.raises(ValueError, match="no usable request"):
        sample([{"prompt": "a prompt far longer than the context allows"}], max_model_len=4)


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="unknown dataset 'sharegtp'"):
        sample_requests("sharegtp", tok, 4)
    with pytest.raises(ValueError, match="num_prompts must be at least 1"):
        sample_requests("sharegpt", tok, 0)
    with pytest.raises(ValueError, match="input_len"):
        sample_requests("alpaca", tok, 4, input_len=0)
    with pytest.raises(ValueError, match="n must be at least 1"):
        sample_requests("parallel-sampling", tok, 4, n=0)
    with pytest.raises(ValueError, match="prefix_len"):
        sample_requests("shared-prefix", tok, 4, prefix_len=0)
    with pytest.raises(ValueError, match="range_ratio"):
        sample_requests("random", tok, 4, range_ratio=1.5)
    with pytest.raises(ValueError, match="no requests"):
        describe([])


def test_poisson_arrivals():
    arrivals = np.array(poisson_arrivals(4000, request_rate=5.0, seed=1))
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0 and (gaps >= 0).all() and len(arrivals) == 4000
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() == pytest.approx(0.2, rel=0.1)  # exponential: std == mean
    assert poisson_arrivals(50, 5.0, seed=1) == arrivals[:50].tolist()
    assert poisson_arrivals(50, 5.0, seed=2) != arrivals[:50].tolist()
    assert poisson_arrivals(6, float("inf")) == [0.0] * 6
    assert poisson_arrivals(0, 2.0) == []
    for rate in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="request_rate"):
            poisson_arrivals(3, rate)
