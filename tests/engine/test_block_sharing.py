"""KV block sharing with the model: prefix caching and parallel sampling (n > 1) never change greedy outputs,
and every block returns to the pool."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import assert_matches_reference, greedy, hf_greedy

from pagedllm import LLM, BeamSearchParams, LLMEngine, SamplingParams
from pagedllm.config import EngineConfig

MAX_TOKENS = 8
BLOCK_SIZE = 4
NUM_BLOCKS = 30  # 120 tokens: a few of the prompts below at once; cached blocks get evicted and recomputed


def shared_prefix_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts cut from one stem plus a few own tokens; two are exactly 8 full blocks of the stem."""
    rng = random.Random(seed)
    stem = [rng.randrange(100, 49152) for _ in range(37)]
    prompts = [stem[:k] + [rng.randrange(100, 49152) for _ in range(rng.randint(0, 9))]
               for k in (37, 37, 36, 20, 33, 37, 8, 32, 25, 37)]
    return prompts + [stem[:32], stem[:32]]


@pytest.fixture(scope="module")
def shared_reference(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = shared_prefix_prompts()
    return prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


def make_llm(tiny_model_dir: str, **kwargs) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
               max_num_batched_tokens=32, **kwargs)


def generate_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def uncached_outputs(tiny_model_dir, shared_reference):
    prompts, _ = shared_reference
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    outs = generate_tokens(llm, prompts, greedy(MAX_TOKENS))
    assert llm.engine.stats().prefix_cache_hits == 0
    return outs


@pytest.mark.parametrize("collide", [False, True], ids=["hash", "constant-hash"])
def test_prefix_caching_changes_no_output(tiny_model_dir, shared_reference, uncached_outputs, monkeypatch, collide):
    if collide:  # every block hashes alike: a hit must still compare the stored tokens
        monkeypatch.setattr("pagedllm.core.block_manager.hash_block", lambda parent, tokens: 0)
    prompts, refs = shared_reference
    llm = make_llm(tiny_model_dir)
    for _ in range(2):  # the second round finds what the first left in the cache, where not evicted
        assert generate_tokens(llm, prompts, greedy(MAX_TOKENS)) == uncached_outputs
    for (ours,), (ref, logits) in zip(uncached_outputs, refs):
        assert_matches_reference(ours, ref, logits)
    stats = llm.engine.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    assert stats.prefix_cache_hits % BLOCK_SIZE == 0  # counted in tokens, whole blocks
    assert llm.engine.block_manager.pool.num_evictions > 0
    assert stats.blocks_in_use == 0 and llm.engine.block_manager.num_free_blocks == NUM_BLOCKS
    llm.engine.check_invariants()


def test_greedy_samples_of_one_request_all_match_under_preemption(tiny_model_dir, shared_reference,
                                                                  uncached_outputs):
    """n = 2 greedy: each sample equals the single greedy continuation, through forks, copy-on-write of the
    shared last prompt block, group preemption and recompute from the prefix cache."""
    prompts, _ = shared_reference
    llm = make_llm(tiny_model_dir)
    outs = generate_tokens(llm, prompts, SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True))
    assert outs == [[single, single] for (single,) in uncached_outputs]
    stats = llm.engine.stats()
    assert stats.preemptions > 0 and stats.cow_copies > 0
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_parallel_sampling_shares_prompt_blocks_and_frees_them(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=64, block_size=BLOCK_SIZE))
    prompt = list(range(1000, 1010))  # 2 full blocks and a partial one
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))
    engine.step()  # the prompt is prefilled once and the 4 samples fork from it
    assert engine.stats().blocks_in_use == 3
    (out,) = engine.step()  # each sample writes into the shared partial block: 3 copies, the last in place
    stats = engine.stats()
    assert stats.cow_copies == 3 and stats.blocks_in_use == 3 + 3
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and all(len(c.token_ids) == 2 for c in out.outputs)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_free_blocks == 64

    engine.add_request("a", prompt, SamplingParams(n=4, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort_request("a")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 64
    engine.check_invariants()


def test_seeded_parallel_samples_are_reproducible_and_differ(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=128)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    first = [c.token_ids for c in llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate(["other", "Tell me a story"], [SamplingParams(n=2), params],
                                               use_tqdm=False)[1].outputs]
    assert first == again and len(first) == 4
    assert len({tuple(t) for t in first}) > 1
    # Sample i draws from a generator seeded seed + i: it is the n = 1 request with that seed.
    alone = llm.generate("Tell me a story", SamplingParams(temperature=1.0, seed=13, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert alone == first[2]


def test_random_groups_keep_block_invariants(tiny_model_dir):
    """Arrivals with n in 1..3, sampling, aborts and a pool that forces preemption: invariants after every step."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=16, block_size=4,
                                    max_num_batched_tokens=32, max_num_seqs=6))
    rng = random.Random(1)
    stem = [rng.randrange(100, 49152) for _ in range(30)]
    for step in range(300):
        if step < 25 and rng.random() < 0.7:
            n = rng.randint(1, 3)
            prompt = stem[:rng.randint(1, 30 // n)] + [rng.randrange(100, 49152) for _ in range(rng.randint(0, 2))]
            engine.add_request(f"q{step}", prompt, SamplingParams(n=n, temperature=rng.choice([0.0, 0.8]),
                                                                  max_tokens=rng.randint(4, 20), ignore_eos=True))
        if engine.groups and rng.random() < 0.05:
            engine.abort_request(rng.choice(sorted(engine.groups)))
        engine.step()
        engine.check_invariants()
        if step >= 25 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert engine.stats().preemptions > 0 and engine.stats().cow_copies > 0


def test_beam_search_width_one_is_greedy_and_beams_share_blocks(tiny_model_dir, shared_reference):
    prompts = shared_reference[0][:3]
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=128, block_size=BLOCK_SIZE)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0), use_tqdm=False)
    as_prompts = [{"prompt_token_ids": p} for p in prompts]
    narrow = llm.beam_search(as_prompts, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    for p, out, beam in zip(prompts, plain, narrow):
        (seq,) = beam.sequences
        assert seq.tokens == p + out.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(out.outputs[0].cumulative_logprob, abs=1e-4)
        assert seq.text == out.outputs[0].text
    hits = llm.engine.stats().prefix_cache_hits
    wide = llm.beam_search(as_prompts, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    for p, beam in zip(prompts, wide):
        seqs = beam.sequences
        assert len({tuple(s.tokens) for s in seqs}) == 3
        assert all(s.tokens[:len(p)] == p and len(s.tokens) == len(p) + 6 for s in seqs)
        scores = [s.cum_logprob for s in seqs]
        assert scores == sorted(scores, reverse=True)
    assert llm.engine.stats().prefix_cache_hits > hits  # the beams' common prefixes came from the cache
    assert llm.engine.block_manager.num_free_blocks == 128


def test_prefix_caching_flag():
    import argparse

    from pagedllm.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args([])).enable_prefix_caching
    assert not EngineConfig.from_cli_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching


def test_groups_that_cannot_run_are_rejected_and_the_rest_fit_the_pool(tiny_model_dir):
    """n samples must fit the pool even unshared (a group alone always runs): longer ones are refused up front,
    and max_tokens is capped to what fits."""
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=8, block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([1, 2, 3], SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(ValueError, match="do not fit"):
        llm.generate([[7] * 9], SamplingParams(n=4), use_tqdm=False)
    (out,) = llm.generate([[7, 8, 9, 10, 11]], SamplingParams(n=4, max_tokens=None, temperature=1.0,
                                                              ignore_eos=True), use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [3] * 4  # 8 blocks // 4 samples = 8 tokens each
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_free_blocks == 8


def reference_beam_search(model, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Beam search the plain way: every beam recomputed from scratch by transformers, nothing shared."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, score in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = logprobs.topk(2 * width)
            candidates += [(tokens + [t], score + lp) for t, lp in zip(top.indices.tolist(), top.values.tolist())]
        beams = sorted(candidates, key=lambda b: b[1] / len(b[0]), reverse=True)[:width]
    return beams


def test_beam_search_equals_reference_beam_search(tiny_model_dir, shared_reference):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = shared_reference[0][:2]
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=64, block_size=BLOCK_SIZE)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    for p, out in zip(prompts, outs):
        ref = reference_beam_search(model, p, 3, 5)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        for s, (_, score) in zip(out.sequences, ref):
            assert s.cum_logprob == pytest.approx(score, abs=1e-3)
    assert llm.engine.block_manager.num_free_blocks == 64
