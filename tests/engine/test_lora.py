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
    bm = llm.engine.block_manager
    assert bm.pool.num_used == bm.num_adapter_blocks > 0  # only the resident (now idle) adapters hold blocks


@pytest.mark.parametrize("engine_args", [
    dict(max_loras=3, enable_prefix_caching=True),
    dict(max_loras=3, enable_prefix_caching=False, attention_backend="reference"),
    # adapters wait for a slot; adapter 3's weights take 44 of the 60 blocks while it is resident: preemption
    dict(max_loras=1, num_blocks=60, max_num_batched_tokens=16),
], ids=["mixed-prefix-cache", "reference-path", "one-slot-small-pool"])
def test_mixed_adapters_equal_peft(tiny_model_dir, adapters, engine_args):
    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, enable_lora=True, max_lora_rank=16, **engine_args)
    # the C++ SGMV kernel computes the deltas, the torch path on the reference path
    assert (llm.engine.runner.model.lora.ext is None) == (engine_args.get("attention_backend") == "reference")
    check_mixed_batch(llm, adapters)
    slots = llm.engine.scheduler.adapters
    slots.check()
    if engine_args["max_loras"] == 1:
        assert slots.num_evictions >= 2 and llm.engine.stats().preemptions > 0


def test_adapter_weights_are_paged_with_the_kv_cache(tiny_model_dir, adapters):
    """A resident adapter holds blocks of the pool (its bytes / a KV block's, rounded up); idle, it gives them back
    when the KV cache needs them, and is loaded again (same outputs) when a request needs it again."""
    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, enable_lora=True, max_loras=2, max_lora_rank=16,
              num_blocks=60, max_num_batched_tokens=16, max_cpu_loras=1)
    engine, bm = llm.engine, llm.engine.block_manager
    big = next(r for r in adapters if r is not None and r.lora_int_id == 3)
    prompt = prompts()[0]
    first = llm.generate({"prompt_token_ids": prompt}, greedy(MAX_TOKENS), use_tqdm=False, lora_request=big)
    # its paged layout: per layer, A's 64 or 128 rows of 16 floats and B's 16 rows per 64 output columns, 176 pages
    # of 512 bytes (one layer's K or V of a block), 4 a block: its 90,112 bytes exactly (rank 16: no padding)
    assert bm.num_adapter_blocks == engine.scheduler.adapters.sizes[3] == 44
    assert engine.stats().lora_adapters_resident == 1
    long_prompt = [100 + i for i in range(60)]  # 18 blocks with its output: more than the 16 the adapter leaves
    llm.generate({"prompt_token_ids": long_prompt}, greedy(MAX_TOKENS), use_tqdm=False)
    assert bm.num_adapter_blocks == 0 and engine.scheduler.adapters.num_evictions == 1
    other = next(r for r in adapters if r is not None and r.lora_int_id == 2)
    llm.generate("hi", greedy(2), use_tqdm=False, lora_request=other)  # the CPU copy of adapter 3 goes (1 kept)
    again = llm.generate({"prompt_token_ids": prompt}, greedy(MAX_TOKENS), use_tqdm=False, lora_request=big)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert engine.runner.adapters.num_reads == 1  # read from its folder again
    engine.check_invariants()
    engine.scheduler.adapters.check()


def test_adapter_blocks_hold_its_weights_then_serve_kv(tiny_model_dir, adapters):
    """The blocks a resident adapter holds contain its weights' bytes and the kernel reads them there (NaN written
    into them reaches the output); evicted, those blocks hold other sequences' K/V, whose outputs stay exact, and the
    adapter, loaded again into other blocks, gives its outputs again."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model.lora import LoRABatch

    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, enable_lora=True, max_loras=1, max_lora_rank=16,
              num_blocks=60, max_num_batched_tokens=16, enable_prefix_caching=True)
    engine, bm, runner = llm.engine, llm.engine.block_manager, llm.engine.runner
    lora, big = runner.model.lora, next(r for r in adapters if r is not None and r.lora_int_id == 3)
    first = llm.generate({"prompt_token_ids": prompts()[0]}, greedy(MAX_TOKENS), use_tqdm=False, lora_request=big)
    held = list(bm.adapter_blocks[3])
    pool = b"".join(lora.page(held, i).numpy().tobytes() for i in range(len(held) * 2 * lora.num_layers))
    adapter = runner.adapters.get(3)
    for (_, projection), (a, b) in adapter.weights.items():
        if projection in ("o_proj", "down_proj"):  # one projection, rank 16: its A and B^T rows are contiguous
            assert a.T.contiguous().numpy().tobytes() in pool and b.T.contiguous().numpy().tobytes() in pool
    x = torch.randn(3, lora.in_features["o"])
    batch = LoRABatch.build(torch.tensor([runner.adapter_slots[3]] * 3), torch.float32)
    assert lora.add_delta(torch.zeros(3, 64), x, 0, "o", batch).isfinite().all()
    for k_cache, v_cache in runner.kv_caches:
        k_cache[held] = float("nan")
        v_cache[held] = float("nan")
    assert lora.add_delta(torch.zeros(3, 64), x, 0, "o", batch).isnan().all()  # read from the blocks themselves
    long_prompt = [100 + i for i in range(60)]  # 18 blocks with its output: some of the adapter's
    out = llm.generate({"prompt_token_ids": long_prompt}, greedy(MAX_TOKENS), use_tqdm=False)
    assert bm.num_adapter_blocks == 0 and set(bm.pool.contents) & set(held)  # its K/V cached in former adapter blocks
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert_matches_reference(out[0].outputs[0].token_ids, *hf_greedy(hf, long_prompt, MAX_TOKENS))
    again = llm.generate({"prompt_token_ids": prompts()[0]}, greedy(MAX_TOKENS), use_tqdm=False, lora_request=big)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    engine.check_invariants()


def test_the_torch_path_reads_only_the_steps_slots(tiny_model_dir, adapters):
    """The torch path's dense copy of the pages skips the slots of no token of the step: an evicted adapter's slot
    between two used ones may point at blocks that hold K/V now (NaN here), and must change nothing."""
    import torch

    from pagedllm.model.lora import LoRABatch

    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, enable_lora=True, max_loras=3, max_lora_rank=16,
              attention_backend="reference")
    llm.generate(["hi"] * 3, greedy(1), use_tqdm=False, lora_request=[r for r in adapters if r is not None])
    runner, lora = llm.engine.runner, llm.engine.runner.model.lora
    assert lora.ext is None and sorted(runner.adapter_slots.values()) == [0, 1, 2]
    kind = sorted(lora.kinds[1])[0]  # a fused matmul slot 1's adapter targets
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, lora.in_features[kind], generator=g)
    base = torch.randn(4, sum(lora.widths[kind]), generator=g)
    batch = LoRABatch.build(torch.tensor([0, 2, 0, 2]), torch.float32)
    expected = lora.add_delta(base.clone(), x, 0, kind, batch)
    for k_cache, v_cache in runner.kv_caches:
        k_cache[lora.blocks[1]] = float("nan")
        v_cache[lora.blocks[1]] = float("nan")
    assert torch.equal(lora.add_delta(base.clone(), x, 0, kind, batch), expected)


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
    with open(tmp_path / "adapter_model.safetensors", "wb") as f:  # bigger than any rank-8 adapter of this model
        f.truncate(llm.engine.config.max_lora_rank * 10**7)
    with pytest.raises(LoRALoadError, match="more than an adapter of this model"):
        llm.engine.add_lora(LoRARequest("huge", 9, str(tmp_path)))
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 64}}')
    with pytest.raises(LoRALoadError, match="rank 64 exceeds max_lora_rank 8"):  # refused from its config alone
        llm.engine.add_lora(LoRARequest("declared", 10, str(tmp_path)))
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


def test_the_kv_tier_keeps_the_base_models_blocks_only(tiny_model_dir, adapters, tmp_path):
    """An adapter's id names nothing that outlives the process, so its blocks never go to the second tier: after a
    restart on the same directory, every adapter still equals its reference and only the base model's prefixes
    come back from the tier."""
    def run(engine_dir: str) -> LLM:
        llm = LLM(tiny_model_dir, dtype="float32", block_size=4, enable_lora=True, max_loras=4, max_lora_rank=16,
                  kv_offload_dir=engine_dir)
        check_mixed_batch(llm, adapters)
        return llm

    first = run(str(tmp_path / "tier"))
    first.engine.close()
    base_blocks = sum((len(p) - 1) // 4 for p in prompts())  # full blocks of the base model's prompts
    second = run(str(tmp_path / "tier"))
    tier = second.engine.stats().kv_tier
    assert 0 < tier["hits"] <= base_blocks and tier["read_errors"] == 0
    second.engine.close()



def test_bfloat16_kernel_equals_the_torch_path(tiny_model_dir, adapters):
    """In bfloat16, each layer's adapter deltas of the three resident adapters (and of no adapter) mixed in one batch:
    the kernel (fp32 sums, one rounding) within bf16 rounding of the torch path (rounded after each matmul)."""
    import torch

    from pagedllm.model.lora import FUSED, LoRABatch

    llm = LLM(tiny_model_dir, dtype="bfloat16", block_size=4, enable_lora=True, max_loras=3, max_lora_rank=16)
    llm.generate(["hi"] * len(adapters), greedy(1), use_tqdm=False, lora_request=list(adapters))  # all resident
    lora, slots = llm.engine.runner.model.lora, llm.engine.runner.adapter_slots
    assert lora.ext is not None and len(slots) == len(adapters) - 1
    g = torch.Generator().manual_seed(0)
    batch = LoRABatch.build(torch.tensor([-1, *slots.values()] * 5)[torch.randperm(20, generator=g)], torch.bfloat16)
    for layer in range(lora.num_layers):
        for kind in FUSED:
            x = torch.randn(20, lora.in_features[kind], generator=g).to(torch.bfloat16)
            base = torch.randn(20, sum(lora.widths[kind]), generator=g).to(torch.bfloat16)
            got = lora.add_delta(base.clone(), x, layer, kind, batch)
            a, b = lora.dense(layer, kind, slice(0, lora.max_loras))  # read back from the adapters' blocks
            expected = lora.add_delta_padded(base.clone(), x, a, b, batch)
            torch.testing.assert_close(got, expected, rtol=2 ** -6, atol=2 ** -6)
            assert not torch.equal(got, base)  # adapter 1 targets every projection
            no_adapter = sorted(set(range(20)) - set(batch.tokens.tolist()))
            assert torch.equal(got[no_adapter], base[no_adapter])
