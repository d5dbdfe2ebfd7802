"""Batched multi-LoRA against transformers + PEFT: sequences of different adapters (and of none) run in one step,
with prefix caching and preemption, and each greedy output equals its merged reference token for token."""

from __future__ import annotations

import random

import pytest
from conftest import make_peft_adapter, peft_reference_model
from test_engine import assert_matches_reference, greedy, hf_greedy

from pagedllm import LLM, LoRARequest
from pagedllm.model.loader.peft import LoRALoadError

MAX_TOKENS = 10
ADAPTERS = [  # (seed, rank, alpha, targets, rsLoRA): ranks and targets differ, one scales by sqrt(r)
    (1, 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (2, 4, 8, ("q_proj", "v_proj"), False),
    (3, 16, 8, ("gate_proj", "up_proj", "down_proj", "o_proj"), True),
]


def prompts(seed: int = 5) -> list[list[int]]:
    """A few prompts, two of them sharing a stem of full blocks (the prefix cache must not share it across
    adapters)."""
    rng = random.Random(seed)
    stem = [rng.randrange(100, 49152) for _ in range(20)]
    own = [[rng.randrange(100, 49152) for _ in range(n)] for n in (3, 11, 7)]
    return [stem + own[0], stem + own[1], own[2]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """LoRA requests for the tiny model, and each one's reference outputs (None: the base model)."""
    made = [(None, None)]
    for seed, r, alpha, targets, rslora in ADAPTERS:
        path = make_peft_adapter(tiny_model_dir, str(tmp_path_factory.mktemp(f"lora{seed}")), seed, r, alpha, targets,
                                 rslora)
        made.append((LoRARequest(f"adapter{seed}", seed, path), path))
    references = {}
    for request, path in made:
        model = peft_reference_model(tiny_model_dir, path) if path else None
        if model is None:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        references[request] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts()]
    return references


def check_mixed_batch(llm: LLM, references: dict) -> None:
    """Every prompt with every adapter and with none, all queued at once, each equal to its reference."""
    jobs = [(request, i, p) for request in references for i, p in enumerate(prompts())]
    outs = llm.generate([{"prompt_token_ids": p} for _, _, p in jobs], greedy(MAX_TOKENS), use_tqdm=False,
                        lora_request=[request for request, _, _ in jobs])
    for (request, i, _), out in zip(jobs, outs):
        ref, ref_logits = references[request][i]
        assert_matches_reference(out.outputs[0].token_ids, ref, ref_logits)
    outputs = {request: [out.outputs[0].token_ids for (r, _, _), out in zip(jobs, outs) if r == request]
               for request in references}
    assert len({tuple(map(tuple, o)) for o in outputs.values()}) == len(references), "an adapter changed nothing"
    llm.engine.check_invariants()
    assert llm.engine.block_manager.pool.num_used == 0


@pytest.mark.parametrize("engine_args", [
    dict(max_loras=3, enable_prefix_caching=True),
    dict(max_loras=3, enable_prefix_caching=False, attention_backend="reference"),
    dict(max_loras=1, num_blocks=12, max_num_batched_tokens=16),  # adapters wait for a slot; preemption
], ids=["mixed-prefix-cache", "reference-path", "one-slot-small-pool"])
def test_mixed_adapters_equal_peft(tiny_model_dir, adapters, engine_args):
    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, enable_lora=True, max_lora_rank=16, **engine_args)
    check_mixed_batch(llm, adapters)
    slots = llm.engine.scheduler.adapters
    slots.check()
    if engine_args["max_loras"] == 1:
        assert slots.num_evictions >= 2


def test_one_step_runs_several_adapters(tiny_model_dir, adapters):
    """The adapters really share steps (not one adapter's requests after another's)."""
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    runner, kinds = llm.engine.runner, []
    build = runner.lora_batch

    def recording(scheduled, lens):
        kinds.append(len({s.seq.lora_int_id for s in scheduled}))
        return build(scheduled, lens)

    runner.lora_batch = recording
    check_mixed_batch(llm, adapters)
    assert max(kinds) == len(adapters)  # three adapters and the base model in one step


def test_bad_adapters_are_refused(tiny_model_dir, tmp_path, adapters):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    path = next(r for r in adapters if r is not None and r.lora_int_id == 3).lora_path
    with pytest.raises(LoRALoadError, match="rank 16 exceeds max_lora_rank 8"):
        llm.generate("hi", greedy(2), lora_request=LoRARequest("big", 3, path), use_tqdm=False)
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        llm.engine.add_lora(LoRARequest("missing", 7, str(tmp_path / "nothing")))
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRALoadError, match="cannot read safetensors"):
        llm.engine.add_lora(LoRARequest("corrupt", 8, str(tmp_path)))
    assert llm.engine.list_loras() == []
    assert llm.generate("hi", greedy(2), use_tqdm=False)[0].outputs[0].token_ids  # the engine still serves


def test_adapter_of_another_model_is_refused(tmp_path, adapters):
    from conftest import make_tiny_hf_model

    other = make_tiny_hf_model(str(tmp_path / "wide"), hidden_size=128, intermediate_size=256)
    llm = LLM(other, dtype="float32", enable_lora=True)
    path = next(r for r in adapters if r is not None and r.lora_int_id == 1).lora_path
    with pytest.raises(LoRALoadError, match="do not fit the base model"):
        llm.engine.add_lora(LoRARequest("other", 1, path))


def test_lora_needs_enable_lora(tiny_model_dir, adapters):
    llm = LLM(tiny_model_dir, dtype="float32")
    request = next(r for r in adapters if r is not None)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("hi", greedy(2), lora_request=request, use_tqdm=False)
