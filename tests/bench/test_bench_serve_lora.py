"""What the multi-LoRA side by side (docs/scripts/side_by_side_lora.sh) relies on: `pagedllm bench lora
--save-adapters` writes loadable random adapters, and `pagedllm bench serve --models` spreads the requests over several
model names (adapters and the base model) by a seeded Zipf law, each request reaching the model it names. Behaviour
only, never a timing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from pagedllm.bench.lora import write_random_adapter
from pagedllm.bench.serve import request_models
from pagedllm.bench.server_process import ServerProcess
from pagedllm.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_request_models_are_seeded_and_favour_the_first_names() -> None:
    assert request_models(None, 5, 1.0, 0) is None  # no --models: every request names --model, as before
    picks = request_models("a, b,c", 3000, 1.0, 0)
    assert picks == request_models("a,b,c", 3000, 1.0, 0) != request_models("a,b,c", 3000, 1.0, 1)
    assert picks.count("a") > picks.count("b") > picks.count("c") > 0
    assert 1300 < request_models("a,b", 3000, 0.0, 0).count("a") < 1700  # exponent 0: uniform
    with pytest.raises(ValueError, match="names no model"):
        request_models(" , ", 3, 1.0, 0)


def test_save_adapters_writes_loadable_adapters_that_change_the_model(tiny_model_dir: str, tmp_path: Path) -> None:
    import torch

    from pagedllm.model.loader import load_model
    from pagedllm.model.loader.peft import load_peft_adapter

    assert main(["bench", "lora", "--model", tiny_model_dir, "--save-adapters", str(tmp_path), "--num-adapters", "2",
                 "--rank", "4", "--targets", "q_proj,v_proj"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["lora0", "lora1"]
    config = load_model(tiny_model_dir).config
    for name in ("lora0", "lora1"):
        settings = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert settings["r"] == 4 and settings["target_modules"] == ["q_proj", "v_proj"]
        load_peft_adapter(str(tmp_path / name), config, 4, torch.float32)  # raises on any problem
    a0, a1 = (load_file(str(tmp_path / n / "adapter_model.safetensors")) for n in ("lora0", "lora1"))
    assert len(a0) == config.num_hidden_layers * 2 * 2  # A and B of q and v in every layer
    assert all(t.abs().sum() > 0 for t in a0.values())  # B nonzero: the adapter changes outputs
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)  # one seed per adapter


def lora_requests(metrics_text: str) -> dict[str, float]:
    """pagedllm:lora_requests_total by adapter name."""
    return {s.labels["lora_name"]: s.value for family in text_string_to_metric_families(metrics_text)
            for s in family.samples if s.name == "pagedllm:lora_requests_total"}


def test_bench_serve_sends_each_request_to_its_model(tiny_model_dir: str, tmp_path: Path) -> None:
    from pagedllm.model.loader import load_model

    config = load_model(tiny_model_dir).config
    modules = [f"a{i}={write_random_adapter(str(tmp_path / f'a{i}'), config, 4, ('q_proj', 'v_proj'), i)}"
               for i in range(2)]
    argv = ["--model", tiny_model_dir, "--served-model-name", "base", "--dtype", "float32", "--threads", "1",
            "--attention-backend", "reference", "--num-blocks", "128", "--max-model-len", "256",
            "--disable-log-requests", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "4",
            "--lora-modules", *modules]
    out = tmp_path / "serve.json"
    with ServerProcess(argv, str(tmp_path / "server.log"), timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)}) as server:
        assert main(["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_model_dir, "--model", "base",
                     "--models", "a0,a1,base", "--dataset", "random", "--num-prompts", "12", "--input-len", "8",
                     "--output-len", "3", "--max-concurrency", "4", "--metrics-interval", "0",
                     "--output-json", str(out)]) == 0
        served = lora_requests(httpx.get(f"{server.url}/metrics").text)
    result = json.loads(out.read_text())
    assert result["num_failed"] == 0 and result["total_output_tokens"] == 12 * 3
    per_model = result["requests_per_model"]
    assert sum(per_model.values()) == 12 and per_model["a0"] > per_model.get("base", 0)
    assert served == {name: per_model.get(name, 0) for name in ("a0", "a1")}  # the server saw each adapter's share
