"""Hugging Face transformers as a benchmark baseline: the same requests on the same weights, run by `generate` on
static batches (the classic baseline) or by transformers' own continuous batching (`ContinuousBatchingManager`).

Every request generates exactly its `output_len` tokens, greedily, EOS ignored, as `pagedllm bench throughput` runs
them. Nothing is downloaded: HF folders load from disk, GGUF files become a transformers model holding the weights
pagedllm's loader dequantized.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Protocol

import torch
from tqdm import tqdm

from pagedllm.config import EngineConfig, fixed_step_budget
from pagedllm.model.bf16_choice import torch_dtype_name
from pagedllm.model.tokenizer import Tokenizer

MODES = ("static", "continuous")
# pagedllm engine options that continuous batching takes too (same meaning, transformers' names in cb_config)
ENGINE_OPTIONS = ("block_size", "num_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                  "enable_prefix_caching")
ATTENTION = ("sdpa", "eager")  # transformers' CPU attentions; continuous batching runs eager as "paged|eager"
PAD_ID = 0  # any id: padded positions are masked out
NO_EOS: list[int] = []  # generation stops only at max_new_tokens (pagedllm's ignore_eos): nothing stops, nothing banned


class Request(Protocol):
    """What a benchmark request must have (pagedllm.bench.datasets.BenchRequest does)."""

    prompt_token_ids: list[int]
    output_len: int


def add_hf_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("baseline")
    g.add_argument("--backend", default="pagedllm", choices=["pagedllm", "hf"],
                   help="hf: the same requests on Hugging Face transformers (same weights, no paging)")
    g.add_argument("--hf-mode", default="static", choices=list(MODES),
                   help="static: generate() on FCFS batches, each padded on the left and run until its longest "
                        "request is done; continuous: transformers' continuous batching (generate_batch's manager)")
    g.add_argument("--hf-batch-size", type=int, default=32, help="static mode: requests per batch")


def load_hf_model(model: str | None, dtype: torch.dtype,
                  attn_implementation: str = "sdpa") -> tuple[torch.nn.Module, Tokenizer, str]:
    """(transformers model, tokenizer, name) for what pagedllm serves from `model`: an HF folder through
    from_pretrained (local files only); a GGUF file (None: the default model) as transformers' class for its
    architecture holding the weights our loader dequantized."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import default_model_path, load_model

    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                  local_files_only=True)
        return hf.eval(), Tokenizer.from_dir(path), os.path.basename(os.path.normpath(path))
    loaded = load_model(path, dtype)
    hf = AutoModelForCausalLM.from_config(hf_config(loaded.config), dtype=dtype,
                                          attn_implementation=attn_implementation)
    missing, unexpected = hf.load_state_dict(loaded.weights, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{path}: weights do not fit transformers' model (missing {missing}, unexpected {unexpected})")
    hf.tie_weights()
    return hf.eval(), loaded.tokenizer, loaded.name


def hf_config(c):
    """transformers' config for a pagedllm ModelConfig (GGUF checkpoints carry no config.json)."""
    from transformers import AutoConfig

    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
    extra = {} if c.architecture == "Qwen2ForCausalLM" else {"attention_bias": c.attention_bias}
    eos = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids
    return AutoConfig.for_model(
        model_type[c.architecture], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=eos,
        rope_parameters={"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}, **extra)


def greedy_config(max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=NO_EOS, pad_token_id=PAD_ID)


@torch.no_grad()
def generate_static(model, requests: Sequence[Request], batch_size: int) -> list[list[int]]:
    """The classic baseline: FCFS batches of `batch_size`, left-padded, each generating until its longest request is
    done. Returns each request's own `output_len` tokens (the rest of its row is waste, not output)."""
    from torch.nn.utils.rnn import pad_sequence

    outputs = []
    bar = tqdm(total=len(requests), desc="hf generate", unit="req", disable=None, dynamic_ncols=True)
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        prompts = [torch.tensor(r.prompt_token_ids) for r in batch]
        input_ids = pad_sequence(prompts, batch_first=True, padding_value=PAD_ID, padding_side="left")
        mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True, padding_side="left")
        out = model.generate(input_ids=input_ids, attention_mask=mask,
                             generation_config=greedy_config(max(r.output_len for r in batch)))
        width = input_ids.shape[1]
        outputs += [row[width:width + r.output_len].tolist() for row, r in zip(out, batch)]
        bar.update(len(batch))
    bar.close()
    return outputs


def continuous_manager(model, requests: Sequence[Request], cb_config):
    """transformers' continuous batching manager, started, sized for `requests` (a context manager). Starting it
    allocates the paged cache; stopping it joins its thread (up to a second): neither is part of a timed run."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                          max_generated_length=max(r.output_len for r in requests), num_requests=len(requests))
    return model.continuous_batching_context_manager(generation_config=greedy_config(hints.max_generated_length),
                                                     continuous_batching_config=cb_config, workload_hints=hints,
                                                     timeout=5)


def generate_continuous(manager, requests: Sequence[Request]) -> list[list[int]]:
    """Every request queued at once with its own max_new_tokens, then each one's tokens once it finishes, as
    generate_batch does (which takes one max_new_tokens for all requests, hence driving its manager here)."""
    for i, r in enumerate(requests):
        manager.add_request(r.prompt_token_ids, request_id=f"req-{i}", max_new_tokens=r.output_len)
    results: dict[str, list[int]] = {}
    bar = tqdm(total=len(requests), desc="hf continuous batching", unit="req", disable=None, dynamic_ncols=True)
    while len(results) < len(requests):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers continuous batching failed on {result.request_id}: {result.error}")
            results[result.request_id] = result.generated_tokens
            bar.update()
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped before finishing every request "
                               f"({len(results)} of {len(requests)} done)")
    bar.close()
    return [results[f"req-{i}"] for i in range(len(requests))]


def continuous_batching_config(config: EngineConfig, model_config, dtype: torch.dtype):
    """transformers' ContinuousBatchingConfig sized like a pagedllm engine with the same options: page size =
    block_size, the same number of KV blocks (from kv_cache_memory as the engine counts them; `model_config` is
    transformers', where Qwen2 has no head_dim), batch limits, prefix sharing. (Sized explicitly: on a CPU without
    psutil transformers cannot measure free memory and would size its cache from the whole machine's RAM.)"""
    from transformers import ContinuousBatchingConfig

    from pagedllm.model.model_runner import kv_bytes_per_block

    c = model_config
    shape = SimpleNamespace(num_hidden_layers=c.num_hidden_layers, num_key_value_heads=c.num_key_value_heads,
                            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    num_blocks = config.num_blocks or config.kv_cache_bytes // kv_bytes_per_block(shape, config.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory!r} holds no block of {config.block_size} tokens")
    return ContinuousBatchingConfig(page_size=config.block_size, num_blocks=num_blocks,
                                    max_batch_tokens=fixed_step_budget(config.max_num_batched_tokens),
                                    max_requests_per_batch=config.max_num_seqs,
                                    allow_block_sharing=config.enable_prefix_caching, auto_switch_to_flash=False)


def run_hf(requests: Sequence[Request], model: str | None, dtype: str, mode: str = "static", batch_size: int = 32,
           threads: int | None = None, **cb_options) -> dict:
    """Time `requests` on transformers; the same result keys as `pagedllm bench throughput`. `cb_options`: pagedllm's
    engine options (ENGINE_OPTIONS, sizing continuous batching like the engine) and `attn_implementation`."""
    if mode not in MODES:
        raise ValueError(f"hf mode must be one of {', '.join(MODES)}, got {mode!r}")
    if batch_size < 1:
        raise ValueError(f"hf batch size must be positive, got {batch_size}")
    attn_implementation = cb_options.pop("attn_implementation", "sdpa")
    if attn_implementation not in ATTENTION:
        raise ValueError(f"attn_implementation must be one of {', '.join(ATTENTION)}, got {attn_implementation!r}")
    unknown = set(cb_options) - set(ENGINE_OPTIONS)
    if unknown:
        raise ValueError(f"unknown hf backend options {sorted(unknown)}; known: {', '.join(ENGINE_OPTIONS)}")
    if not requests:
        raise ValueError("no requests to run")
    if any(r.output_len < 1 or not r.prompt_token_ids for r in requests):
        raise ValueError("every request needs a prompt and output_len >= 1")
    config = EngineConfig(model=model, dtype=dtype, threads=threads, **cb_options)
    torch.set_num_threads(config.num_threads)
    torch_dtype = getattr(torch, torch_dtype_name(config))

    t_load = time.perf_counter()
    hf, _, name = load_hf_model(model, torch_dtype, attn_implementation)
    cb_config = continuous_batching_config(config, hf.config, torch_dtype) if mode == "continuous" else None
    load_s = time.perf_counter() - t_load

    with continuous_manager(hf, requests, cb_config) if cb_config else contextlib.nullcontext() as manager:
        start = time.perf_counter()
        outputs = generate_continuous(manager, requests) if cb_config else generate_static(hf, requests, batch_size)
        elapsed = time.perf_counter() - start

    n_in = sum(len(r.prompt_token_ids) for r in requests)
    n_out = sum(len(o) for o in outputs)
    result = {
        "backend": "hf", "hf_mode": mode, "model": name, "dtype": torch_dtype_name(config),
        "threads": config.num_threads, "attn_implementation": attn_implementation,
        "batch_size": batch_size if mode == "static" else config.max_num_seqs,
        "num_prompts": len(requests), "input_tokens": n_in, "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "load_s": round(load_s, 3),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    if cb_config is not None:
        result |= {"num_blocks": cb_config.num_blocks, "block_size": cb_config.page_size,
                   "max_num_batched_tokens": cb_config.max_batch_tokens}
    return result
