"""`pagedllm bench lora` on the tiny model: random adapters are written and served, and no request fails when more
adapters than slots share the pool (behaviour only, never a timing)."""

from __future__ import annotations

import json

from pagedllm.bench.lora import zipf_picks
from pagedllm.entrypoints.cli import main


def test_zipf_favours_the_first_adapters():
    import random

    picks = zipf_picks(10, 2000, 1.0, random.Random(0))
    assert set(picks) <= set(range(10)) and picks.count(0) > picks.count(1) > picks.count(9)


def test_bench_lora_serves_more_adapters_than_slots(tiny_model_dir, tmp_path):
    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--model", tiny_model_dir, "--dtype", "float32", "--threads", "1",
                 "--num-blocks", "600", "--num-adapters", "3", "--many-adapters", "12", "--max-loras", "2",
                 "--max-cpu-loras", "4", "--rank", "4", "--num-prompts", "12", "--input-len", "8", "--output-len", "4",
                 "--repeats", "1", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["base"]["failed"] == result["mixed_3"]["failed"] == result["many_12"]["failed"] == 0
    assert result["many_12"]["output_tokens"] == 12 * 4 and result["many_12"]["adapter_loads"] >= 3
