"""Block pool, block manager and scheduler without a model: invariants after every step of random workloads."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core.block_manager import BlockManager, Write, blocks_for
from pagedllm.core.block_pool import BlockPool, NoFreeBlocksError
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams


def make_seq(rid: str, prompt_len: int, max_tokens: int, n: int = 1) -> Sequence:
    """Prompts all start 1, 2, 3, ...: they share prefixes, so the prefix cache is exercised too."""
    return Sequence(rid, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, n=n),
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
    sim.next_token = lambda seq: rng.randrange(3)  # samples of one request diverge, or not
    submitted = []
    for step in range(3000):
        if step < 60 and rng.random() < 0.4:
            n = rng.randint(1, min(3, max_num_seqs))
            capacity = num_blocks // n * block_size  # what the engine allows each of n samples
            prompt = rng.randint(1, max(1, capacity // 2))
            max_tokens = rng.randint(1, max(1, min(40, capacity - prompt)))
            seq = make_seq(f"r{step}", prompt, max_tokens, n)
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


class FakeCache:
    """The block manager driven directly, with a fake KV cache holding each slot's token: after every operation
    each sequence must read its own tokens back through its block table (shared, copied or found in the cache)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _write(self, sid: int, start: int) -> None:
        """Copy-on-write copies first (all sources read before any destination is written), then the new tokens."""
        copies = self.bm.take_copies()
        data = [list(self.slots[src]) for src, _ in copies]
        for (_, dst), d in zip(copies, data):
            self.slots[dst] = d
        table = self.bm.block_tables[sid]
        for pos in range(start, len(self.tokens[sid])):
            self.slots[table[pos // self.bs]][pos % self.bs] = self.tokens[sid][pos]
        self.bm.cache_full_blocks(sid, self.tokens[sid], len(self.tokens[sid]))

    def _fits(self, write: Write) -> bool:
        """blocks_needed is exact: allocation then takes exactly that many free blocks."""
        need = self.bm.blocks_needed([write])
        self.expected_free = self.bm.num_free_blocks - need
        return need <= self.bm.num_free_blocks

    def new(self, tokens: list[int]) -> None:
        sid, self.next_id = self.next_id, self.next_id + 1
        prefix = self.bm.match_prefix(tokens)
        start = len(prefix.blocks) * self.bs
        assert start < len(tokens)
        if not self._fits(Write(sid, start, len(tokens), prefix)):
            return
        self.tokens[sid] = list(tokens)
        self.bm.share_prefix(sid, prefix, len(tokens))
        self.bm.allocate(sid, len(tokens), start)
        assert self.bm.num_free_blocks == self.expected_free
        self._write(sid, start)

    def append(self, sid: int, token: int) -> None:
        n = len(self.tokens[sid]) + 1
        if not self._fits(Write(sid, n - 1, n)):
            return
        self.tokens[sid].append(token)
        self.bm.append_slot(sid, n)
        assert self.bm.num_free_blocks == self.expected_free
        self._write(sid, n - 1)

    def fork(self, sid: int) -> None:
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])

    def free(self, sid: int) -> None:
        self.bm.free(sid)
        del self.tokens[sid]

    def check(self) -> None:
        self.bm.check()
        referenced = {b for t in self.bm.block_tables.values() for b in t}
        assert self.bm.num_free_blocks + len(referenced) == self.bm.num_total_blocks
        for sid, tokens in self.tokens.items():
            table = self.bm.block_tables[sid]
            assert len(table) == blocks_for(len(tokens), self.bs)
            assert [self.slots[table[p // self.bs]][p % self.bs] for p in range(len(tokens))] == tokens, sid


@pytest.mark.parametrize("collide", [False, True], ids=["hash", "constant-hash"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(4, 24), seed=st.integers(0, 10_000))
def test_fork_append_cow_free_evict_keep_invariants_and_contents(monkeypatch, collide, block_size, num_blocks,
                                                                  seed):
    if collide:  # every block hashes alike: only the stored tokens tell them apart
        monkeypatch.setattr("pagedllm.core.block_manager.hash_block", lambda parent, tokens: 0)
    rng = random.Random(seed)
    fc = FakeCache(num_blocks, block_size)
    stems = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]  # few stems: prompts share prefixes
    for _ in range(150):
        op = rng.random()
        live = sorted(fc.tokens)
        if op < 0.3 or not live:
            fc.new(rng.choice(stems)[:rng.randint(1, 12)] + [rng.randrange(3) for _ in range(rng.randint(0, 3))])
        elif op < 0.65:
            fc.append(rng.choice(live), rng.randrange(3))
        elif op < 0.8:
            fc.fork(rng.choice(live))
        else:
            fc.free(rng.choice(live))
        fc.check()
    for sid in sorted(fc.tokens):
        fc.free(sid)
    fc.check()
    assert fc.bm.num_free_blocks == num_blocks


def test_prefix_cache_reuses_full_blocks_and_evicts_lru_tail_first():
    fc = FakeCache(num_blocks=6, block_size=2)
    fc.new([1, 2, 3, 4, 5])  # blocks: [1 2] [3 4] [5]
    first = list(fc.bm.block_tables[0])
    fc.free(0)
    fc.new([1, 2, 3, 4, 9])  # the two full blocks come from the cache
    assert fc.bm.block_tables[1][:2] == first[:2]
    fc.new([1, 2, 3, 4])  # whole prompt cached: the last token is recomputed, so only [1 2] is shared
    assert fc.bm.block_tables[2][0] == first[0] and fc.bm.block_tables[2][1] != first[1]
    fc.check()
    fc.free(1)
    fc.free(2)
    assert fc.bm.num_free_blocks == 6 and fc.bm.pool.num_cached_free >= 2
    order = list(fc.bm.pool.free)  # uncached first, then cached with a sequence's tail before its head
    cached = [b for b in order if b in fc.bm.pool.contents]
    assert all(b not in fc.bm.pool.contents for b in order[:len(order) - len(cached)])
    assert cached.index(first[1]) < cached.index(first[0])


def test_fork_shares_and_copy_on_write_leaves_last_sharer_in_place():
    fc = FakeCache(num_blocks=8, block_size=4)
    fc.new([1, 2, 3, 4, 5, 6])  # one full block and a partial one
    for _ in range(3):
        fc.fork(0)
    assert fc.bm.pool.num_used == 2 and fc.bm.pool.ref_counts[fc.bm.block_tables[0][1]] == 4
    for sid in range(4):
        fc.append(sid, 10 + sid)
        fc.check()
    assert fc.bm.num_cow_copies == 3 and fc.bm.pool.num_used == 2 + 3  # the fourth writes in place
    assert len({fc.bm.block_tables[sid][0] for sid in range(4)}) == 1  # the full block stays shared
