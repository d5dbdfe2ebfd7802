"""The second tier on the server's surface: its flags, and its counters on /metrics as engine.stats() has them."""

from __future__ import annotations

import argparse
import random

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.metrics import KV_TIER_COUNTERS, EngineStats


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(list(argv)))


def test_the_flags_take_sizes_with_units():
    config = parse("--kv-offload-dir", "/tmp/tier", "--kv-offload-size", "32GiB")
    assert config.kv_offload_dir == "/tmp/tier" and config.kv_offload_size == 32 << 30
    assert parse("--kv-offload-dir", "d", "--kv-offload-size", "500M").kv_offload_size == 500 << 20
    assert parse("--kv-offload-dir", "d", "--kv-offload-size", "4096").kv_offload_size == 4096  # bare: bytes
    assert parse().kv_offload_dir is None
    with pytest.raises(SystemExit):
        parse("--kv-offload-size", "lots")
    with pytest.raises(ValueError, match="needs prefix caching"):
        parse("--kv-offload-dir", "d", "--no-enable-prefix-caching")


def test_tier_counters_reach_metrics(tiny_model_dir, tmp_path):
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=24, block_size=4, kv_offload_dir=str(tmp_path / "tier"))
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 49152) for _ in range(33)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    stats = EngineStats("tiny")
    for _ in range(2):  # six prompts of 8 full blocks do not fit 24 blocks: the second round restores
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.flush_kv_tier(30)
        stats.record(llm.engine, [])
    tier = llm.engine.stats().kv_tier
    samples = {s.name: s.value for family in text_string_to_metric_families(generate_latest(stats.registry).decode())
               for s in family.samples}
    assert tier["hits"] > 0 and tier["misses"] > 0
    for name in KV_TIER_COUNTERS:
        assert samples[f"pagedllm:kv_tier_{name}_total"] == pytest.approx(tier[name])
    assert samples["pagedllm:kv_tier_stored_bytes"] == tier["stored_bytes"] > 0
    llm.engine.close()
