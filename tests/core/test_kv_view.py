"""The KV view (core/kv_view.py) without a model: diffs applied in order rebuild the full picture after every step,
each block's state says what the pool and the tables hold, and the events match the counters."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from test_scheduler import Sim, make_seq

from pagedllm.config import SchedulerConfig
from pagedllm.core.baselines import make_scheduler
from pagedllm.core.kv_events import KVRecorder
from pagedllm.core.kv_view import CACHED, FREE, RESERVED, SHARED, USED, KVSnapshot, KVView


def apply(mirror: dict[int, tuple[int, int]], snap: KVSnapshot) -> None:
    """What a dashboard does with a snapshot: a full one resets every block to free first."""
    if snap.full:
        mirror.clear()
    for i in range(0, len(snap.blocks), 3):
        block, state, rc = snap.blocks[i:i + 3]
        mirror[block] = (state, rc)


def expected_states(sched) -> dict[int, tuple[int, int]]:
    """Each block's state from first principles: holders counted over the tables, stored tokens from sequences."""
    bm, pool = sched.block_manager, sched.block_manager.pool
    holders = Counter(b for t in bm.block_tables.values() for b in t)
    stored: set[int] = set()
    for group in sched.running:
        for seq in group.seqs:
            if bm.has_table(seq.seq_id):
                full_or_part = -(-seq.num_computed_tokens // bm.block_size)
                stored.update(bm.block_table(seq.seq_id)[:full_or_part])
    states = {}
    for b in range(pool.num_blocks):
        rc = holders[b]
        assert rc == pool.ref_counts[b]
        if rc == 0:
            state = CACHED if b in pool.contents else FREE
        else:
            state = (SHARED if rc > 1 else USED) if b in stored else RESERVED
        if state != FREE:
            states[b] = (state, rc)
    return states


def non_free(mirror: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    return {b: v for b, v in mirror.items() if v[0] != FREE}


@pytest.mark.parametrize("seed", range(6))
def test_diffs_rebuild_the_pool_after_every_step(seed: int) -> None:
    rng = random.Random(seed)
    sim = Sim(num_blocks=24, block_size=4, max_num_seqs=6, budget=32)
    sim.next_token = lambda seq: rng.randrange(3)
    view = KVView(sim.sched, keep=4)
    mirror: dict[int, tuple[int, int]] = {}
    version, kinds = None, Counter()
    for step in range(400):
        if step < 80 and rng.random() < 0.4:
            n = rng.randint(1, 3)
            capacity = 24 // n * 4  # what the engine allows each of n samples
            prompt = rng.randint(1, capacity // 2)
            sim.add(make_seq(f"r{step}", prompt, rng.randint(1, capacity - prompt), n))
        if sim.live and rng.random() < 0.02:
            sim.abort(rng.choice(sorted(sim.live)))
        if sim.sched.has_unfinished():
            sim.step()
        if step % 3 == 0 or not sim.sched.has_unfinished():
            snap = view.snapshot(version)
            assert snap.full == (version is None)
            version = snap.version
            apply(mirror, snap)
            kinds.update(e.kind for e in snap.events)
            assert non_free(mirror) == expected_states(sim.sched)
            assert [r.request_id for r in snap.requests] == [g.request_id for g in
                                                              [*sim.sched.running, *sim.sched.waiting][:64]]
        if step >= 80 and not sim.sched.has_unfinished():
            break
    c = view.snapshot(version).counters
    assert (kinds["cow"], kinds["preempt"], kinds["evict"], kinds["fork"]) == (c.cow_copies, c.preemptions,
                                                                                c.evictions, c.forks)
    assert c.blocks_in_use == 0 and c.num_running == c.num_waiting == 0
    assert c.preemptions and c.forks and kinds["prefix_hit"]  # this workload does all of it


def test_sharing_cow_prefix_hits_and_cached_blocks_show() -> None:
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=4, budget=64)
    view = KVView(sim.sched)
    sim.add(make_seq("a", 9, 3, n=2))  # 9-token prompt: 2 full blocks + 1 partial, shared by 2 samples
    sim.step()
    snap = view.snapshot()
    states = dict(zip(snap.blocks[::3], zip(snap.blocks[1::3], snap.blocks[2::3])))
    assert sorted(states.values()) == [(SHARED, 2)] * 3
    assert [e.kind for e in snap.events] == ["fork"]
    (request,) = snap.requests
    assert request.status == "running" and request.n == 2
    assert [s.tokens_stored for s in request.samples] == [9, 9]
    assert request.samples[0].block_table == request.samples[1].block_table
    assert {s.slots_held for s in request.samples} == {12}

    sim.step()  # both samples write into the shared last block: the first copies it
    snap2 = view.snapshot(snap.version)
    assert not snap2.full and [e.kind for e in snap2.events] == ["cow"]
    assert snap2.events[0].request_id == "a#0"  # named from the sequence it copied for
    src, dst = snap2.events[0].blocks
    changed = dict(zip(snap2.blocks[::3], zip(snap2.blocks[1::3], snap2.blocks[2::3])))
    assert changed[src] == (USED, 1) and changed[dst] == (USED, 1)

    while sim.live:
        sim.step()
    sim.add(make_seq("b", 9, 2))  # same 9 tokens: finds the 2 full blocks in the cache
    snap3 = view.snapshot(snap2.version)
    assert {v[0] for v in zip(snap3.blocks[1::3])} <= {CACHED, FREE}
    assert snap3.counters.blocks_cached_free >= 2
    assert snap3.requests[0].status == "waiting"
    sim.step()
    snap4 = view.snapshot(snap3.version)
    hits = [e for e in snap4.events if e.kind == "prefix_hit"]
    assert len(hits) == 1 and hits[0].tokens == 8 and hits[0].request_id == "b"


def test_preempted_requests_and_the_preempt_event() -> None:
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, budget=64)
    view = KVView(sim.sched)
    sim.add(make_seq("old", 6, 8))
    sim.add(make_seq("new", 6, 8))
    snaps = []
    while sim.sched.has_unfinished():
        sim.step()
        snaps.append(view.snapshot(snaps[-1].version if snaps else None))
    events = [e for s in snaps for e in s.events if e.kind == "preempt"]
    assert events and events[0].request_id == "new" and events[0].blocks
    statuses = {r.request_id: r.status for s in snaps for r in s.requests if r.request_id == "new"}
    assert "preempted" in {r.status for s in snaps for r in s.requests} and statuses


def test_reservations_show_as_reserved_until_tokens_fill_them() -> None:
    sched = make_scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, block_size=4,
                                           enable_prefix_caching=False, kv_policy="reserve-max"), 16)
    view = KVView(sched)
    assert view.kv_policy == "reserve-max"
    seq = make_seq("r", 5, 10)
    from pagedllm.core.sequence import SequenceGroup

    sched.add(SequenceGroup.make(seq))
    mirror: dict[int, tuple[int, int]] = {}
    version = None
    for _ in range(6):
        plan = sched.schedule()
        sched.commit(plan)
        for s in plan.scheduled:
            for q in s.samplers:
                q.append_token(7, 0.0)
        snap = view.snapshot(version)
        version = snap.version
        apply(mirror, snap)
        assert non_free(mirror) == expected_states(sched)
    counts = Counter(state for state, _ in mirror.values())
    assert counts[RESERVED] == 8 - 3 and counts[USED] == 3  # 32-token reservation, 10 tokens stored


def test_an_old_version_or_lost_changes_give_a_full_snapshot() -> None:
    sim = Sim(num_blocks=8, block_size=2, max_num_seqs=2, budget=16)
    view = KVView(sim.sched, keep=2)
    first = view.snapshot()
    view.snapshot(first.version)
    view.snapshot()
    assert view.snapshot(first.version).full  # fell out of the last `keep`
    recorder = KVRecorder(max_changes=3)
    for b in range(5):
        recorder.changed(b)
    assert recorder.changes_since(0) is None and recorder.changes_since(3) == {3, 4}
    for i in range(5):
        recorder.record("evict", blocks=(i,))
    events, dropped = recorder.events_since(1, limit=2)
    assert [e.blocks for e in events] == [(3,), (4,)] and dropped == 2
