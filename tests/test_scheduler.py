"""Block pool, block manager and scheduler without a model: invariants after every step of random workloads."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.block_manager import BlockManager, blocks_for
from pagedllm.block_pool import BlockPool, NoFreeBlocksError
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler
from pagedllm.sequence import Sequence, SequenceGroup


def make_seq(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(rid, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    RequestMetrics(0.0), max_tokens=max_tokens)


def test_pool_take_release_and_refcounts():
    pool = BlockPool(3)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert pool.num_free == 0 and {a, b, c} == {0, 1, 2}
    with pytest.raises(NoFreeBlocksError):
        pool.take()
    pool.incref(a)
    pool.release(a)
    assert pool.num_free == 0  # still held once
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 2
    pool.check()


def test_block_taken_only_when_previous_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("s", 3)
    assert len(bm.block_tables["s"]) == 1
    bm.append_slot("s", 4)
    assert len(bm.block_tables["s"]) == 1  # the 4th token still fits in the first block
    bm.append_slot("s", 5)
    assert len(bm.block_tables["s"]) == 2
    assert bm.slot("s", 4) == bm.block_tables["s"][1] * 4
    assert not bm.can_allocate("t", 4 * 7 + 1) and bm.can_allocate("t", 4 * 6)
    bm.free("s")
    assert bm.num_free_blocks == 8
    bm.check()


class Sim:
    """The engine loop with a fake model: every sampling sequence gets one token per step."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs, budget)
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.finished: dict[str, SequenceGroup] = {}
        self.live: dict[str, SequenceGroup] = {}
        self.next_token = lambda seq: 7

    def add(self, seq: Sequence) -> SequenceGroup:
        group = SequenceGroup.make(seq)
        self.live[seq.request_id] = group
        self.sched.add(group)
        return group

    def abort(self, rid: str) -> None:
        group = self.live.pop(rid)
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish("abort")
        self.sched.finish(group)

    def step(self) -> None:
        plan = self.sched.schedule()
        assert plan.num_batched_tokens <= self.budget
        assert len(self.sched.running) <= self.max_num_seqs
        assert len({id(s.seq) for s in plan.scheduled}) == len(plan.scheduled)
        for s in plan.scheduled:
            table = self.bm.block_tables[s.seq.seq_id]
            assert len(table) == blocks_for(s.start + s.num_new_tokens, self.bm.block_size)  # no block early
            assert s.num_new_tokens >= 1
        self.sched.commit(plan)
        for s in plan.scheduled:
            for seq in s.samplers:
                seq.append_token(self.next_token(seq), 0.0)
                if seq.num_output_tokens >= seq.max_tokens:
                    seq.finish("length")
                group = self.live[seq.request_id]
                self.sched.finish(group)
                if group.is_finished:
                    self.finished[seq.request_id] = self.live.pop(seq.request_id)
        self.bm.check()
        used = len({b for t in self.bm.block_tables.values() for b in t})  # shared blocks count once
        assert self.bm.num_free_blocks + used == self.bm.num_total_blocks


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(8, 40),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    seed=st.integers(0, 10_000),
)
def test_random_workload_keeps_invariants_and_finishes_everything(block_size, num_blocks, max_num_seqs, budget,
                                                                  seed):
    rng = random.Random(seed)
    sim = Sim(num_blocks, block_size, max_num_seqs, budget)
    capacity = num_blocks * block_size
    submitted = []
    for step in range(3000):
        if step < 60 and rng.random() < 0.4:
            prompt = rng.randint(1, max(1, capacity // 2))
            max_tokens = rng.randint(1, max(1, min(40, capacity - prompt)))
            seq = make_seq(f"r{step}", prompt, max_tokens)
            sim.add(seq)
            submitted.append(seq.request_id)
        if sim.live and rng.random() < 0.03:
            sim.abort(rng.choice(sorted(sim.live)))
        if step >= 60 and not sim.sched.has_unfinished():
            break
        sim.step()
    assert not sim.sched.has_unfinished(), "requests were left behind (livelock or lost request)"
    assert sim.bm.num_free_blocks == num_blocks
    for rid, group in sim.finished.items():
        assert all(seq.num_output_tokens == seq.max_tokens for seq in group.seqs), rid


def test_preemption_frees_newest_and_requeues_at_front():
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, budget=64)
    old, new = make_seq("old", 6, 8), make_seq("new", 6, 8)  # 14 tokens each: one fits the pool, two don't
    sim.add(old)
    new_group = sim.add(new)
    sim.step()  # both prefill: 2 blocks each, pool now full
    assert sim.bm.num_free_blocks == 0
    for _ in range(2):  # both fill their second block (tokens 7, 8)
        sim.step()
    sim.step()  # "old" needs a third block: "new" is preempted
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert sim.sched.waiting[0] is new_group and new.num_computed_tokens == 0
    assert new.seq_id not in sim.bm.block_tables
    for _ in range(100):
        if sim.sched.has_unfinished():
            sim.step()
    assert new.num_output_tokens == 8 and old.num_output_tokens == 8
    assert sim.bm.num_free_blocks == 4


def test_chunked_prefill_mixes_decodes_first():
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, budget=8)
    sim.add(make_seq("a", 3, 10))
    sim.step()  # a: whole prompt
    sim.add(make_seq("long", 30, 2))
    plan = sim.sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("long", 7)]
