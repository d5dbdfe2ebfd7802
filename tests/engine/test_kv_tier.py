"""The prefix cache's second tier with the model (--kv-offload-dir): fp32 greedy outputs are identical with and
without it while prefixes leave a small pool and come back from the tier, across a restart and across preemption;
a corrupt tier or one that cannot be written degrades to recompute, never a failed request."""

from __future__ import annotations

import logging
import os
import random

import pytest
from test_block_sharing import BLOCK_SIZE, MAX_TOKENS, NUM_BLOCKS, generate_tokens, make_llm, shared_prefix_prompts
from test_engine import greedy

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.kv_store import KVFileStore


def workload() -> list[list[list[int]]]:
    """Shared-prefix prompts, unrelated prompts that push them out of the 30-block pool, the first ones again."""
    rng = random.Random(5)
    others = [[rng.randrange(100, 49152) for _ in range(rng.randint(30, 44))] for _ in range(8)]
    first = shared_prefix_prompts()
    return [first, others, first]


@pytest.fixture(scope="module")
def uncached(tiny_model_dir) -> list[list[list[int]]]:
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    return [generate_tokens(llm, prompts, greedy(MAX_TOKENS)) for prompts in workload()]


def run_rounds(llm) -> list[list[list[int]]]:
    outs = []
    for prompts in workload():
        outs.append(generate_tokens(llm, prompts, greedy(MAX_TOKENS)))
        assert llm.engine.flush_kv_tier(30)  # on disk: the next round restores from files, not the write queue
    return outs


def tier_files(directory) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(directory) for f in files if f.endswith(".kv")]


def test_the_tier_changes_no_output_and_restores_evicted_prefixes(tiny_model_dir, uncached, tmp_path):
    llm = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "tier"))
    assert run_rounds(llm) == uncached
    stats = llm.engine.stats()
    tier = stats.kv_tier
    assert tier["hits"] > 0 and tier["restored_blocks"] == tier["hits"] and tier["bytes_read"] > 0
    assert tier["read_errors"] == 0 and tier["writes_dropped"] == 0 and tier["writable"] == 1
    assert tier["bytes_written"] == sum(os.path.getsize(p) for p in tier_files(tmp_path / "tier")) > 0
    assert llm.engine.block_manager.pool.num_evictions > 0
    assert stats.blocks_in_use == 0 and llm.engine.block_manager.num_free_blocks == NUM_BLOCKS
    llm.engine.check_invariants()
    llm.engine.close()


def test_a_restarted_engine_finds_the_prefixes_on_disk(tiny_model_dir, uncached, tmp_path, monkeypatch):
    monkeypatch.setattr("pagedllm.engine.kv_offload.RESTORE_CHUNK", 3)  # restores of several chunks
    first = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "tier"))
    assert generate_tokens(first, workload()[0], greedy(MAX_TOKENS)) == uncached[0]
    first.engine.close()  # its blocks let go are written, the directory is free for the next engine
    second = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "tier"))
    assert generate_tokens(second, workload()[0], greedy(MAX_TOKENS)) == uncached[0]
    tier = second.engine.stats().kv_tier
    assert tier["hits"] > 0 and tier["bytes_read"] > 0 and tier["read_errors"] == 0
    second.engine.close()


def test_preempted_sequences_come_back_the_same(tiny_model_dir, uncached, tmp_path):
    """n = 2 greedy in the small pool: groups are preempted, their blocks go to the tier and come back."""
    llm = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "tier"))
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompts, expected in zip(workload(), uncached):
        assert generate_tokens(llm, prompts, params) == [[single, single] for (single,) in expected]
        assert llm.engine.flush_kv_tier(30)
    stats = llm.engine.stats()
    assert stats.preemptions > 0 and stats.kv_tier["hits"] > 0
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS
    llm.engine.close()


def test_a_corrupt_tier_degrades_to_recompute(tiny_model_dir, uncached, tmp_path, caplog):
    first = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "tier"))
    generate_tokens(first, workload()[0], greedy(MAX_TOKENS))
    first.engine.close()
    files = tier_files(tmp_path / "tier")
    for i, path in enumerate(files):  # truncated, a flipped byte, another engine's identity: a third each
        data = bytearray(open(path, "rb").read())
        if i % 3 == 0:
            data = data[:len(data) // 2]
        elif i % 3 == 1:
            data[-1] ^= 0x55
        else:
            data[8:24] = bytes(16)
        open(path, "wb").write(data)
    second = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "tier"))
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert generate_tokens(second, workload()[0], greedy(MAX_TOKENS)) == uncached[0]
    tier = second.engine.stats().kv_tier
    assert tier["read_errors"] > 0 and tier["restored_blocks"] == 0
    assert "KV tier: ignored" in caplog.text
    second.engine.check_invariants()
    second.engine.close()


def test_a_tier_that_cannot_be_written_or_opened_serves_every_request(tiny_model_dir, uncached, tmp_path,
                                                                      monkeypatch, caplog):
    def refuse(path, parts):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(KVFileStore, "_write_file", staticmethod(refuse))
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "tier"))
        assert run_rounds(llm) == uncached
    assert llm.engine.stats().kv_tier["writable"] == 0
    assert caplog.text.count("read-only from now on") == 1
    llm.engine.close()
    (tmp_path / "file").write_text("not a directory")
    llm = make_llm(tiny_model_dir, kv_offload_dir=str(tmp_path / "file" / "tier"))
    assert generate_tokens(llm, workload()[0], greedy(MAX_TOKENS)) == uncached[0]
    assert llm.engine.stats().kv_tier == {}  # off, said once at start


def test_the_tier_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(kv_offload_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_policy="reserve-max")
    assert EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size="32GiB").kv_offload_size == 32 << 30
    assert BLOCK_SIZE == 4


@pytest.mark.slow
def test_the_default_model_restores_a_chat_prefix_after_a_restart(tmp_path):
    """SmolLM2-135M in fp32: a long system prompt computed by one engine comes back from the tier in the next, and
    the greedy continuation is the same token for token."""
    from pagedllm import LLM

    system = "You are a careful assistant. " * 40
    prompts = [f"{system}\nQuestion {i}: name a colour." for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run() -> tuple[list[list[int]], dict]:
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", kv_offload_dir=str(tmp_path / "tier"))
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        tier = llm.engine.stats().kv_tier
        llm.engine.close()
        return outs, tier

    first, _ = run()
    second, tier = run()
    assert second == first and tier["hits"] > 0 and tier["read_errors"] == 0
