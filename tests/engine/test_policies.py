"""Memory policies (paged vs the paper's Orca-style contiguous reservations) and batching modes (continuous vs
static): same outputs, the admission and batching each promises, and honest KV waste figures."""

from __future__ import annotations

import argparse
import itertools
import random

import pytest
from test_engine import MAX_TOKENS, assert_matches_reference, greedy, hf_greedy, mixed_prompts

from pagedllm import LLM, LLMEngine, SamplingParams
from pagedllm.config import BATCHING_MODES, KV_POLICIES, EngineConfig
from pagedllm.core.baselines import reservation_tokens
from pagedllm.core.fairness import INPUT_WEIGHT, OUTPUT_WEIGHT, max_service_gap
from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.service import service_bound
from pagedllm.errors import InvalidRequestError

COMBOS = list(itertools.product(KV_POLICIES, BATCHING_MODES))
COMBO_IDS = [f"{p}-{b}" for p, b in COMBOS]


def make_engine(model: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", threads=1, **kwargs))


def run(engine: LLMEngine, on_step=None) -> None:
    """Step until done, checking the block invariants after every step."""
    while engine.has_unfinished_requests():
        running = {g.request_id for g in engine.scheduler.running}
        engine.step()
        engine.check_invariants()
        if on_step:
            on_step(running, {g.request_id for g in engine.scheduler.running})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.fixture(scope="module")
def reference(hf_tiny):
    prompts = mixed_prompts(8, seed=4)
    return prompts, [hf_greedy(hf_tiny, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("kv_policy,batching", COMBOS, ids=COMBO_IDS)
def test_greedy_output_is_the_same_under_every_policy(tiny_model_dir, reference, kv_policy, batching):
    """Chunked prefill, a pool too small for everything at once, and n = 2 samples (shared blocks under paging,
    a copy of the prompt in each sample's own reservation otherwise): every sample equals transformers."""
    prompts, refs = reference
    llm = LLM(tiny_model_dir, dtype="float32", threads=1, num_blocks=64, block_size=8, max_model_len=128,
              max_num_batched_tokens=40, kv_policy=kv_policy, batching=batching)
    params = [SamplingParams(n=1 + i % 2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (ref, logits) in zip(outs, refs):
        for sample in out.outputs:
            assert_matches_reference(sample.token_ids, ref, logits)
    assert llm.engine.block_manager.num_free_blocks == 64
    assert llm.engine.stats().preemptions == 0 or kv_policy == "paged"  # a reservation never runs out


def test_reservation_sizes():
    assert reservation_tokens("reserve-max", 10, 25, 100) == 100
    assert reservation_tokens("reserve-pow2", 10, 25, 100) == 10 + 32  # the output rounded up to a power of two
    assert reservation_tokens("reserve-pow2", 10, 32, 100) == 10 + 32
    assert reservation_tokens("reserve-pow2", 10, 1, 100) == 10 + 1
    assert reservation_tokens("reserve-pow2", 10, 60, 64) == 64  # capped
    assert reservation_tokens("reserve-oracle", 10, 25, 100) == 35
    with pytest.raises(ValueError):
        reservation_tokens("paged", 10, 25, 100)


# prompt length, max_tokens, and the blocks of 4 tokens each policy reserves
ADMISSION = [(6, 6, {"reserve-max": 16, "reserve-pow2": 4, "reserve-oracle": 3}),  # 64 | 6 + 8 = 14 | 12 tokens
             (9, 3, {"reserve-max": 16, "reserve-pow2": 4, "reserve-oracle": 3}),  # 64 | 9 + 4 = 13 | 12
             (5, 12, {"reserve-max": 16, "reserve-pow2": 6, "reserve-oracle": 5})]  # 64 | 5 + 16 = 21 | 17


@pytest.mark.parametrize("kv_policy", KV_POLICIES)
def test_admission_takes_the_whole_reservation(tiny_model_dir, kv_policy):
    """A 32-block pool of 4 tokens, max_model_len 64: paged runs all 8 requests at once; reserve-max 16 blocks
    each, so 2 at a time; pow2 and oracle the block counts worked out above, taken in full at admission."""
    engine = make_engine(tiny_model_dir, num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=8,
                         kv_policy=kv_policy)
    expected = {}
    for i in range(8):
        prompt_len, max_tokens, blocks = ADMISSION[i % 3]
        seq = engine.add_request(str(i), [100 + i] * prompt_len, greedy(max_tokens))
        expected[seq.seq_id] = blocks.get(kv_policy)
    tables = engine.block_manager.block_tables

    def check_tables(before: set[str], after: set[str]) -> None:
        for seq_id, table in tables.items():
            assert kv_policy == "paged" or len(table) == expected[seq_id]

    run(engine, check_tables)
    peak = engine.stats().peak_num_running
    assert peak == {"paged": 8, "reserve-max": 2, "reserve-pow2": 7, "reserve-oracle": 8}[kv_policy]
    assert engine.stats().preemptions == 0


def running_sets(model: str, kv_policy: str, batching: str) -> list[tuple[set[str], set[str]]]:
    """The running requests before and after every step of 7 requests, batches of at most 3, ending apart."""
    engine = make_engine(model, num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=3,
                         max_num_batched_tokens=16, kv_policy=kv_policy, batching=batching)
    for i in range(7):
        engine.add_request(str(i), [200 + i] * (3 + 4 * i), greedy(2 + 3 * (i % 3)))
    steps: list[tuple[set[str], set[str]]] = []
    run(engine, lambda before, after: steps.append((before, after)))
    return steps


@pytest.mark.parametrize("kv_policy", KV_POLICIES)
def test_static_batching_lets_nothing_join_a_running_batch(tiny_model_dir, kv_policy):
    """The running set only shrinks until it is empty; then the next batch forms, FCFS. Under continuous batching
    the same workload does let requests join, so the check can tell the two apart."""
    steps = running_sets(tiny_model_dir, kv_policy, "static")
    for before, after in steps:
        assert not before or after <= before, f"{after - before} joined the running batch {before}"
    assert [after for before, after in steps if not before] == [{"0", "1", "2"}, {"3", "4", "5"}, {"6"}]
    continuous = running_sets(tiny_model_dir, kv_policy, "continuous")
    assert any(before and not after <= before for before, after in continuous)


def slots_and_tokens_by_definition(engine: LLMEngine) -> tuple[int, int]:
    """Held slots and stored tokens the slow way: every (block, offset) a table holds or has written, once."""
    bs, tables = engine.block_manager.block_size, engine.block_manager.block_tables
    held = {b for table in tables.values() for b in table}
    stored = {(tables[s.seq_id][pos // bs], pos % bs) for g in engine.scheduler.running for s in g.seqs
              if s.seq_id in tables for pos in range(s.num_computed_tokens)}
    return len(held) * bs, len(stored)


def waste_workload(engine: LLMEngine) -> None:
    """Prompts sharing a prefix, n = 3 samples, output lengths that are not powers of two."""
    rng = random.Random(7)
    common = [rng.randrange(100, 49152) for _ in range(9)]
    for i in range(6):
        prompt = common + [rng.randrange(100, 49152) for _ in range(2 + 3 * i)]
        engine.add_request(str(i), prompt, SamplingParams(n=1 + 2 * (i % 2), temperature=0.8, seed=i,
                                                          max_tokens=5 + 4 * i, ignore_eos=True))


@pytest.mark.parametrize("kv_policy,batching", COMBOS, ids=COMBO_IDS)
def test_kv_usage_is_counted_as_defined(tiny_model_dir, monkeypatch, kv_policy, batching):
    """At every step, held slots and stored tokens equal a per-token count over the tables (shared blocks once),
    and the sums over steps add them up."""
    engine = make_engine(tiny_model_dir, num_blocks=40, block_size=4, max_model_len=64, max_num_seqs=6,
                         max_num_batched_tokens=24, kv_policy=kv_policy, batching=batching)
    waste_workload(engine)
    seen = []

    def count(step):
        # finished sequences have left the tables by now; the engine counted before they left
        usage = engine.stats()
        seen.append((usage.kv_slots_held, usage.kv_tokens_stored))
        assert seen[-1] == by_definition.pop()

    by_definition = []
    commit = engine.scheduler.commit

    def commit_and_count(plan):
        commit(plan)
        by_definition.append(slots_and_tokens_by_definition(engine))

    monkeypatch.setattr(engine.scheduler, "commit", commit_and_count)
    engine.add_step_observer(count)
    run(engine)
    stats = engine.stats()
    assert stats.kv_steps == len(seen)
    assert (stats.kv_slots_held_sum, stats.kv_tokens_stored_sum) == tuple(map(sum, zip(*seen)))
    assert stats.kv_waste_fraction == pytest.approx(1 - stats.kv_tokens_stored_sum / stats.kv_slots_held_sum)
    assert 0 <= stats.kv_waste_fraction <= 1 and 0 < stats.peak_num_running <= 6
    sharing = (stats.prefix_cache_hits, stats.cow_copies)
    assert all(sharing) if kv_policy == "paged" else not any(sharing)  # the counts above did meet shared blocks


def test_paged_wastes_least(tiny_model_dir):
    """On one workload: paged (tails of last blocks) < oracle (each reservation's last block) < pow2 < max."""
    waste = {}
    for kv_policy in KV_POLICIES:
        engine = make_engine(tiny_model_dir, num_blocks=64, block_size=4, max_model_len=64, kv_policy=kv_policy)
        waste_workload(engine)
        run(engine)
        waste[kv_policy] = engine.stats().kv_waste_fraction
    assert 0 < waste["paged"] < waste["reserve-oracle"] < waste["reserve-pow2"] < waste["reserve-max"] < 1, waste


@pytest.mark.parametrize("kv_policy,batching", COMBOS, ids=COMBO_IDS)
def test_random_workload_with_aborts_keeps_invariants(tiny_model_dir, kv_policy, batching):
    """Random arrivals, lengths, n and aborts in a pool tight enough to preempt under paging: invariants hold
    after every step and every block is free at the end."""
    engine = make_engine(tiny_model_dir, num_blocks=16, block_size=4, max_model_len=48, max_num_seqs=5,
                         max_num_batched_tokens=16, kv_policy=kv_policy, batching=batching)
    rng = random.Random(11)
    for step in range(300):
        if step < 20 and rng.random() < 0.8:
            n = rng.choice([1, 1, 2])
            params = SamplingParams(n=n, temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 16),
                                    ignore_eos=rng.random() < 0.5, seed=step)
            engine.add_request(str(step), [rng.randrange(100, 49152) for _ in range(rng.randint(1, 24))], params)
        if engine.groups and rng.random() < 0.08:
            engine.abort_request(rng.choice(sorted(engine.groups)))
        engine.step()
        engine.check_invariants()
        if step >= 20 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert (engine.stats().preemptions > 0) == (kv_policy == "paged")  # a reservation never runs out


def test_bad_values_raise_and_the_cli_takes_the_flags():
    with pytest.raises(ValueError, match="kv_policy"):
        EngineConfig(kv_policy="reserve")
    with pytest.raises(ValueError, match="batching"):
        EngineConfig(batching="dynamic")
    assert not EngineConfig(kv_policy="reserve-oracle").enable_prefix_caching  # the baselines share nothing
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--kv-policy", "reserve-pow2", "--batching", "static"]))
    assert (config.kv_policy, config.batching) == ("reserve-pow2", "static")
    config = EngineConfig.from_cli_args(parser.parse_args([]))
    assert (config.kv_policy, config.batching, config.enable_prefix_caching) == ("paged", "continuous", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-policy", "contiguous"])


@pytest.mark.parametrize("policy", ["priority", "fair", "lpm"])
def test_greedy_output_is_the_same_under_every_scheduling_policy(tiny_model_dir, reference, policy):
    """Who waits changes the order, not the tokens: a pool too small for everything at once (so groups are preempted
    and, under priority, displaced), priorities and clients mixed, n = 2 samples; every sample equals transformers."""
    prompts, refs = reference
    llm = LLM(tiny_model_dir, dtype="float32", threads=1, num_blocks=24, block_size=8, max_model_len=128,
              max_num_batched_tokens=40, scheduling_policy=policy)
    params = [SamplingParams(n=1 + i % 2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, client=f"c{i % 3}")
              for i in range(len(prompts))]
    priorities = [(3 * i) % 4 for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=priorities)
    for out, (ref, logits) in zip(outs, refs):
        for sample in out.outputs:
            assert_matches_reference(sample.token_ids, ref, logits)
    assert llm.engine.block_manager.num_free_blocks == 24 and llm.engine.stats().preemptions > 0


def test_scheduling_policy_flags_and_values(tmp_path):
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="scheduling_policy priority needs"):
        EngineConfig(scheduling_policy="priority", batching="static")
    with pytest.raises(ValueError, match="client_weights"):
        EngineConfig(scheduling_policy="fair", client_weights={"a": 0})
    weights = tmp_path / "weights.json"
    weights.write_text('{"batch": 0.5, "alice": 2}')
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--scheduling-policy", "fair", "--client-weights",
                                                           str(weights)]))
    assert config.scheduler_config.scheduling_policy == "fair"
    assert config.scheduler_config.client_weights == {"batch": 0.5, "alice": 2.0}
    assert EngineConfig.from_cli_args(parser.parse_args([])).scheduling_policy == "fcfs"
    weights.write_text('{"batch": -1}')
    with pytest.raises(SystemExit):
        parser.parse_args(["--client-weights", str(weights)])
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams(priority=1.5)
    with pytest.raises(InvalidRequestError, match="client"):
        SamplingParams(client="x" * 300)


def test_lpm_admits_cache_hits_first_and_matches_transformers(tiny_model_dir, hf_tiny):
    """Under lpm, requests that continue a finished one's prompt (a chat's next turns) are admitted before unrelated
    ones that came first, and every greedy output still equals transformers."""
    rng = random.Random(29)
    history = [rng.randrange(100, 49152) for _ in range(40)]  # 5 full blocks of 8, cached once "turn1" is done
    prompts = {"turn1": history, "other1": [rng.randrange(100, 49152) for _ in range(30)],
               "other2": [rng.randrange(100, 49152) for _ in range(20)],
               "turn2": history + [rng.randrange(100, 49152) for _ in range(9)],
               "turn2b": history + [rng.randrange(100, 49152) for _ in range(3)]}
    engine = make_engine(tiny_model_dir, num_blocks=32, block_size=8, max_model_len=96, max_num_seqs=2,
                         max_num_batched_tokens=64, scheduling_policy="lpm")
    outputs: dict[str, list[int]] = {}
    admitted: list[str] = []

    def admissions(before: set[str], after: set[str]) -> None:
        admitted.extend(sorted(after - before - set(admitted)))

    engine.add_request("turn1", prompts["turn1"], greedy())
    for rid in ("other1", "other2", "turn2", "turn2b"):
        if rid == "other1":
            while engine.has_unfinished_requests():
                collect(engine.step(), outputs)
        engine.add_request(rid, prompts[rid], greedy())
    while engine.has_unfinished_requests():
        running = {g.request_id for g in engine.scheduler.running}
        collect(engine.step(), outputs)
        engine.check_invariants()
        admissions(running, {g.request_id for g in engine.scheduler.running})
    assert admitted[:2] == ["turn2", "turn2b"] and engine.stats().prefix_cache_hits >= 2 * 40
    for rid, prompt in prompts.items():
        ref, logits = hf_greedy(hf_tiny, prompt, MAX_TOKENS)
        assert_matches_reference(outputs[rid], ref, logits)


def collect(outs: list, outputs: dict[str, list[int]]) -> None:
    for out in outs:
        if out.finished:
            outputs[out.request_id] = list(out.outputs[0].token_ids)


def ledger_trace(model: str, policy: str) -> tuple[list[tuple[dict, set]], LLMEngine]:
    """A heavy client's 10 requests queued before two light clients' 4 each, on a pool of 8 blocks of 16 tokens and
    2 seats: each client's service after every step, and who was waiting when the step began, as the engine's
    ServiceLedger recorded them."""
    engine = make_engine(model, num_blocks=8, block_size=16, max_model_len=128, max_num_seqs=2,
                         scheduling_policy=policy)
    rng = random.Random(7)
    for client, count, prompt_len, out_len in (("heavy", 10, 40, 16), ("alice", 4, 8, 4), ("bob", 4, 8, 4)):
        for i in range(count):
            engine.add_request(f"{client}{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)],
                               SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0, client=client))
    samples = []
    while engine.has_unfinished_requests():
        engine.step()
        samples.append((engine.service.served(), set(engine.service.backlogged)))
    return samples, engine


def test_the_engines_service_ledger_keeps_the_vtc_bound_under_fair_only(tiny_model_dir):
    """The bound checked on what the engine recorded (core/service.py), not on a model of it: under fair, two
    backlogged clients' service stays within 2·max(w_p·L_input, w_q·M), M the pool's 128 tokens; FCFS serves the
    heavy client's whole queue first and breaks it (here: fair 48, fcfs 660, bound 512)."""
    bound = service_bound(40, 8 * 16)
    fair, engine = ledger_trace(tiny_model_dir, "fair")
    fcfs, _ = ledger_trace(tiny_model_dir, "fcfs")
    clients = engine.service.clients
    assert clients["heavy"].requests == 10 and clients["heavy"].prompt_tokens == 400
    assert clients["heavy"].output_tokens == 160 and clients["alice"].output_tokens == 16
    assert clients["bob"].service == INPUT_WEIGHT * 32 + OUTPUT_WEIGHT * 16
    assert fair[-1][0] == fcfs[-1][0]  # the same work in the end, in another order
    assert max_service_gap(fair) <= bound < max_service_gap(fcfs)



def light_after_heavy(model: str, policy: str) -> tuple[bool, SchedulerOutput]:
    """A heavy client holds both seats with more queued; a light client's request comes between two steps: whether
    the next step sampled its first token, and that step's plan. Then everything runs to the end."""
    engine = make_engine(model, num_blocks=32, block_size=8, max_model_len=128, max_num_seqs=2,
                         max_num_batched_tokens=64, scheduling_policy=policy)
    rng = random.Random(3)
    for i in range(4):
        engine.add_request(f"heavy{i}", [rng.randrange(100, 40000) for _ in range(24)],
                           SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, client="heavy"))
    engine.step()
    engine.step()
    engine.add_request("light", [rng.randrange(100, 40000) for _ in range(8)],
                       SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, client="light"))
    schedule, plans = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    outputs = {out.request_id: out for out in engine.step()}
    run(engine)
    return "light" in outputs and len(outputs["light"].outputs[0].token_ids) == 1, plans[0]


def test_under_fair_a_light_request_gets_its_first_token_in_the_step_after_it_arrives(tiny_model_dir):
    """The engine, not a model of it: under fair the light request is admitted by the very next step (displacing
    the heavy client's newest request, and with no heavy prompt in that step) and samples its first token there;
    under fcfs it waits its turn."""
    first, plan = light_after_heavy(tiny_model_dir, "fair")
    assert first and [g.request_id for g in plan.preempted] == ["heavy1"]
    assert all(s.num_new_tokens == 1 for s in plan.scheduled if s.seq.request_id != "light")
    assert not light_after_heavy(tiny_model_dir, "fcfs")[0]
