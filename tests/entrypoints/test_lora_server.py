"""LoRA adapters over HTTP with the official `openai` client against a real `pagedllm serve`: adapters named by
`model`, listed by /v1/models, loaded and unloaded at run time (vLLM's routes, behind --api-key), bad adapters 400s,
unknown names 404s, and the engine serving on through all of it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import make_peft_adapter, make_tiny_hf_model, no_retry_client

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.bench.server_process import ServerProcess as Server

API_KEY = "sk-lora-test"
REPO = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-adapters")
    other = make_tiny_hf_model(str(root / "other-base"), hidden_size=96, intermediate_size=192)
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    return {
        "a1": make_peft_adapter(tiny_model_dir, str(root / "a1"), seed=11, r=8),
        "a2": make_peft_adapter(tiny_model_dir, str(root / "a2"), seed=12, r=4, targets=("q_proj", "v_proj")),
        "big": make_peft_adapter(tiny_model_dir, str(root / "big"), seed=13, r=32, targets=("q_proj",)),
        "other": make_peft_adapter(other, str(root / "other"), seed=14, r=4),
        "corrupt": str(corrupt),
        "missing": str(root / "missing"),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, adapter_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    args = ["--model", tiny_model_dir, "--dtype", "float32", "--threads", "1", "--attention-backend", "reference",
            "--num-blocks", "128", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--api-key", API_KEY,
            "--lora-modules", f"a1={adapter_dirs['a1']}"]
    with Server(args, str(log), timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}) as s:
        yield s
    assert "Traceback" not in log.read_text(errors="replace")


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return no_retry_client(openai.OpenAI, f"{server.url}/v1", api_key=API_KEY, timeout=60)


def post(server: Server, route: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{route}", json=body, headers=headers, timeout=60)


def complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def test_models_list_adapters_with_their_parent(client: openai.OpenAI):
    cards = {m.id: m for m in client.models.list().data}
    base = next(m for m in cards.values() if m.id != "a1")
    assert cards["a1"].parent == base.id


def test_adapter_output_equals_the_offline_engine(client: openai.OpenAI, tiny_model_dir: str,
                                                  adapter_dirs: dict[str, str]):
    llm = LLM(tiny_model_dir, dtype="float32", attention_backend="reference", enable_lora=True)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    base, adapted = (llm.generate(PROMPT, greedy, use_tqdm=False, lora_request=r)[0].outputs[0].text
                     for r in (None, LoRARequest("a1", 1, adapter_dirs["a1"])))
    assert base != adapted
    base_name = next(m.id for m in client.models.list().data if m.id != "a1")
    assert complete(client, "a1") == adapted
    assert complete(client, base_name) == base
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "a1" and chat.choices[0].finish_reason in ("length", "stop")


def test_load_use_and_unload_at_run_time(server: Server, client: openai.OpenAI, adapter_dirs: dict[str, str]):
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapter_dirs["a2"]},
                key=None).status_code == 401  # --api-key guards the LoRA routes
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapter_dirs["a2"]})
    assert r.status_code == 200, r.text
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapter_dirs["a2"]}
                ).status_code == 400  # already loaded
    assert "a2" in {m.id for m in client.models.list().data}
    assert complete(client, "a2") != complete(client, "a1")
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert r.status_code == 200, r.text
    assert "a2" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "a2")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 404


@pytest.mark.parametrize("which, message", [
    ("big", "exceeds max_lora_rank 16"),
    ("other", "do not fit the base model"),
    ("corrupt", "cannot read safetensors"),
    ("missing", "no adapter_config.json"),
])
def test_bad_adapters_are_400s_and_the_engine_serves_on(server: Server, client: openai.OpenAI,
                                                        adapter_dirs: dict[str, str], which: str, message: str):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": which, "lora_path": adapter_dirs[which]})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert which not in {m.id for m in client.models.list().data}
    assert complete(client, "a1")


def test_unknown_model_is_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "no-such-adapter")
    assert e.value.body["code"] == "model_not_found"


def test_metrics_count_requests_and_tokens_per_loaded_adapter(server: Server, client: openai.OpenAI):
    complete(client, "a1")
    text = httpx.get(f"{server.url}/metrics").text
    lines = {line.split(" ")[0]: float(line.split(" ")[1])
             for line in text.splitlines() if line.startswith("pagedllm:")}
    requests = next(v for k, v in lines.items() if k.startswith("pagedllm:lora_requests_total") and 'a1"' in k)
    tokens = next(v for k, v in lines.items() if k.startswith("pagedllm:lora_generation_tokens_total") and 'a1"' in k)
    assert requests >= 1 and tokens >= 8
    assert not any('lora_name="a2"' in k for k in lines)  # unloaded: its series are gone
    assert next(v for k, v in lines.items() if k.startswith("pagedllm:lora_adapters_loaded")) >= 1
    assert next(v for k, v in lines.items() if k.startswith("pagedllm:lora_adapter_blocks")) > 0
