"""The default model (SmolLM2-135M) serving two random PEFT adapters and the base model in one batch: each greedy
fp32 output equals transformers + PEFT with that adapter, token for token (the tiny model's tests cover the rest)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine import assert_greedy_of, greedy

from pagedllm import LLM, LoRARequest
from pagedllm.bench.hf_backend import load_hf_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
ADAPTERS = [  # (seed, rank, targets)
    (1, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (2, 8, ("q_proj", "v_proj")),
]


def peft_adapter(base: torch.nn.Module, path: str, seed: int, rank: int, targets: tuple[str, ...]) -> torch.nn.Module:
    """A random adapter for the default model, made and saved by PEFT (lora_B randomized: PEFT's zeros change
    nothing); the PEFT model it was saved from (on a copy of `base`), the reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # PEFT's lora_A initialisation
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                            lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape))
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """Each LoRA request (None: the base model) with its reference model (transformers, + PEFT's adapter)."""
    base, tokenizer, _ = load_hf_model(None, torch.float32)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    refs = {None: base.eval()}
    for seed, rank, targets in ADAPTERS:
        path = str(tmp_path_factory.mktemp(f"smollm2-lora{seed}"))
        refs[LoRARequest(f"lora{seed}", seed, path)] = peft_adapter(base, path, seed, rank, targets)
    return {"prompts": prompts, "refs": refs}


def test_default_model_with_adapters_in_one_batch_equals_peft(references):
    prompts, refs = references["prompts"], references["refs"]
    llm = LLM(dtype="float32", kv_cache_memory="256MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    jobs = [(request, i) for request in refs for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in jobs], greedy(MAX_TOKENS), use_tqdm=False,
                        lora_request=[request for request, _ in jobs])
    for (request, i), out in zip(jobs, outs):
        assert_greedy_of(refs[request], prompts[i], list(out.outputs[0].token_ids), MAX_TOKENS)
    by_request = {request: tuple(tuple(out.outputs[0].token_ids) for (r, _), out in zip(jobs, outs) if r == request)
                  for request in refs}
    assert len(set(by_request.values())) == len(refs), "an adapter changed nothing"
    llm.engine.check_invariants()
