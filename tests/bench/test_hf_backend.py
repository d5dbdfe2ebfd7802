"""The transformers baseline (pagedllm.bench.hf_backend) runs the same requests as pagedllm: exactly output_len greedy
tokens per request, the same tokens as pagedllm's (fp32), in both modes, on the same weights."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import pytest
import torch
from conftest import TINY_VOCAB

from pagedllm import LLM, SamplingParams
from pagedllm.bench.datasets import synthetic_requests
from pagedllm.bench.hf_backend import (
    continuous_batching_config,
    continuous_manager,
    generate_continuous,
    generate_static,
    load_hf_model,
    run_hf,
)
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import main

THROUGHPUT_KEYS = {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "load_s",
                   "input_tokens", "output_tokens", "num_prompts", "model", "dtype", "threads", "backend", "hf_mode",
                   "batch_size"}


@dataclass
class Request:  # the fields of pagedllm.bench.datasets.BenchRequest that the backend reads
    prompt_token_ids: list[int]
    output_len: int


def make_requests(n: int = 7, seed: int = 0) -> list[Request]:
    """Mixed prompt and output lengths, so static batches pad prompts and run past their shorter requests."""
    rng = random.Random(seed)
    return [Request([rng.randrange(1000, 49152) for _ in range(rng.choice([1, 3, 17, 40]))], rng.choice([1, 5, 12]))
            for _ in range(n)]


@pytest.fixture(scope="module")
def requests_and_pagedllm(tiny_model_dir):
    requests = make_requests()
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=128)
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                        [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests],
                        use_tqdm=False)
    return requests, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32)[0]


def test_static_batches_generate_pagedllms_greedy_tokens(hf_tiny, requests_and_pagedllm):
    requests, ours = requests_and_pagedllm
    outputs = generate_static(hf_tiny, requests, batch_size=3)  # batches of mixed prompt and output lengths
    assert [len(o) for o in outputs] == [r.output_len for r in requests]
    assert outputs == ours


def test_continuous_batching_generates_pagedllms_greedy_tokens(hf_tiny, requests_and_pagedllm):
    requests, ours = requests_and_pagedllm
    # Small pages, few blocks and a small token budget: prompts are chunked and requests wait for room.
    options = EngineConfig(block_size=4, num_blocks=48, max_num_batched_tokens=16, max_num_seqs=3)
    with continuous_manager(hf_tiny, requests, continuous_batching_config(options, hf_tiny.config,
                                                                          torch.float32)) as manager:
        outputs = generate_continuous(manager, requests)
    assert [len(o) for o in outputs] == [r.output_len for r in requests]
    assert outputs == ours


def test_gguf_becomes_the_same_transformers_model(tiny_model_dir, tiny_gguf_path, hf_tiny):
    """The GGUF path rebuilds transformers' config from ours: same logits as from_pretrained on the HF folder."""
    from_gguf, tokenizer, name = load_hf_model(tiny_gguf_path, torch.float32)
    assert type(from_gguf) is type(hf_tiny) and name == "tiny-llama"
    ids = torch.tensor([make_requests(1, seed=3)[0].prompt_token_ids + [5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(from_gguf(ids).logits, hf_tiny(ids).logits, rtol=1e-5, atol=1e-5)
    assert tokenizer.encode("hello world") == load_hf_model(tiny_model_dir, torch.float32)[1].encode("hello world")


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_run_hf_reports_throughput_keys_and_counts_only_requested_tokens(tiny_model_dir, mode):
    requests = make_requests(5, seed=1)
    result = run_hf(requests, tiny_model_dir, "float32", mode, batch_size=2, threads=1, num_blocks=64)
    assert THROUGHPUT_KEYS <= set(result)
    assert result["backend"] == "hf" and result["hf_mode"] == mode and result["threads"] == 1
    assert result["num_prompts"] == 5 and result["dtype"] == "float32"
    assert result["model"] == os.path.basename(tiny_model_dir)
    assert result["output_tokens"] == sum(r.output_len for r in requests)  # static batches ran longer: not counted
    assert result["input_tokens"] == sum(len(r.prompt_token_ids) for r in requests)
    assert result["batch_size"] == (2 if mode == "static" else EngineConfig().max_num_seqs)


def test_continuous_cache_holds_kv_cache_memory_as_the_engine_counts_it(tiny_qwen2_dir):
    """Qwen2 (biases; transformers' config has no head_dim): blocks from kv_cache_memory as pagedllm sizes them."""
    from pagedllm.model.loader import load_model
    from pagedllm.model.model_runner import kv_bytes_per_block

    requests = make_requests(3, seed=2)
    result = run_hf(requests, tiny_qwen2_dir, "float32", "continuous", kv_cache_memory="2MiB", block_size=8)
    per_block = kv_bytes_per_block(load_model(tiny_qwen2_dir).config, 8, torch.float32)
    assert result["num_blocks"] == (2 << 20) // per_block and result["block_size"] == 8
    assert result["output_tokens"] == sum(r.output_len for r in requests)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="beam"), "hf mode must be one of static, continuous"),
    (dict(batch_size=0), "hf batch size must be positive"),
    (dict(attn_implementation="flash_attention_2"), "attn_implementation must be one of"),
    (dict(max_model_len=64), "unknown hf backend options"),
    (dict(dtype="float16"), "dtype must be auto, bfloat16 or float32"),
])
def test_bad_arguments_are_rejected_before_loading(kwargs, message):
    args = dict(requests=make_requests(2), model="/nonexistent", dtype="float32") | kwargs
    with pytest.raises(ValueError, match=message):
        run_hf(**args)


def test_bench_throughput_runs_on_the_hf_backend(tiny_model_dir, tmp_path):
    path = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--dtype", "float32", "--num-blocks", "64",
                 "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--range-ratio", "0.5",
                 "--backend", "hf", "--hf-mode", "continuous", "--output-json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["backend"] == "hf" and result["hf_mode"] == "continuous" and result["num_prompts"] == 3
    expected = synthetic_requests(3, 8, 4, 0.5, TINY_VOCAB, seed=0)
    assert result["num_blocks"] == 64 and result["output_tokens"] == sum(out for _, out in expected)
