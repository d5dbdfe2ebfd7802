"""LoRA adapter slots: residency, eviction of idle adapters only, and their weights counted in the block pool."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.adapters import AdapterSlots
from pagedllm.core.baselines import make_scheduler
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams


def make(num_blocks: int = 20, max_loras: int = 2) -> tuple[BlockManager, AdapterSlots]:
    bm = BlockManager(num_blocks, 4)
    slots = AdapterSlots(max_loras, bm)
    slots.sizes.update({1: 3, 2: 5, 3: 4})
    return bm, slots


def test_resident_adapters_hold_blocks_and_only_idle_ones_are_evicted():
    bm, slots = make()
    slots.acquire(1)
    slots.acquire(2)
    loads = slots.take_loads()  # each with the blocks its adapter holds, where the runner writes its weights
    assert bm.num_free_blocks == 20 - 3 - 5 and [(a, s) for a, s, _ in loads] == [(1, 0), (2, 1)]
    assert [list(blocks) for *_, blocks in loads] == [bm.adapter_blocks[1], bm.adapter_blocks[2]]
    assert [len(blocks) for *_, blocks in loads] == [3, 5]
    assert not slots.can_acquire(3)  # both slots run
    slots.acquire(1)  # a second group of adapter 1: no load
    slots.release(1)
    assert not slots.can_acquire(3)  # adapter 1 still has a group running
    slots.release(1)
    assert slots.can_acquire(3) and slots.blocks_to_acquire(3) == 4 - 3  # it takes adapter 1's slot and blocks
    slots.acquire(3)
    assert slots.take_loads() == [(3, 0, tuple(bm.adapter_blocks[3]))] and slots.num_evictions == 1
    assert bm.num_free_blocks == 20 - 5 - 4 and set(bm.adapter_blocks) == {2, 3}
    slots.check()
    bm.check()


def test_idle_adapters_give_blocks_back_and_a_forgotten_one_frees_its_slot():
    bm, slots = make()
    slots.acquire(1)
    slots.acquire(2)
    slots.release(1)
    slots.release(2)
    assert slots.evict_idle_except(keep=1)  # the least recent is 1, kept: 2 goes
    assert set(bm.adapter_blocks) == {1} and bm.num_free_blocks == 17
    assert not slots.evict_idle_except(keep=1)
    slots.acquire(1)
    assert not slots.forget(1)  # in use
    slots.release(1)
    assert slots.forget(1) and bm.num_free_blocks == 20 and slots.free_slots
    slots.check()
    bm.check()


def test_resident_adapters_need_no_blocks_to_acquire():
    _, slots = make()
    slots.acquire(2)
    assert slots.blocks_to_acquire(2) == 0 and slots.blocks_to_acquire(0) == 0 and slots.blocks_to_acquire(1) == 3


def lora_group(rid: str, lora_int_id: int, prompt_len: int = 6) -> SequenceGroup:
    seq = Sequence(rid, None, list(range(100 + len(rid), 100 + len(rid) + prompt_len)),
                   SamplingParams(max_tokens=4), RequestMetrics(0.0), 4, lora_int_id=lora_int_id)
    return SequenceGroup.make(seq)


def test_a_request_whose_adapter_has_no_slot_waits_and_later_ones_go_first():
    scheduler = make_scheduler(SchedulerConfig(max_loras=1, block_size=4), num_blocks=40)
    scheduler.adapters.sizes.update({1: 2, 2: 2})
    a, b, c, base = lora_group("a", 1), lora_group("b", 2), lora_group("c", 1), lora_group("d", 0)
    for group in (a, b, c, base):
        scheduler.add(group)
    plan = scheduler.schedule()
    assert {s.seq.request_id for s in plan.scheduled} == {"a", "c", "d"}  # b's adapter has no slot: it waits
    assert plan.lora_loads == [(1, 0, tuple(scheduler.block_manager.adapter_blocks[1]))]
    assert list(scheduler.waiting) == [b]
    assert scheduler.block_manager.num_adapter_blocks == 2
    for group in (a, c):
        for seq in group.seqs:
            seq.finish("length")
        scheduler.finish(group)
    plan = scheduler.schedule()  # adapter 1 is idle now: evicted for adapter 2
    assert "b" in {s.seq.request_id for s in plan.scheduled} and [load[:2] for load in plan.lora_loads] == [(2, 0)]
    assert set(scheduler.block_manager.adapter_blocks) == {2}
    scheduler.adapters.check()
    scheduler.block_manager.check()


def test_the_kv_view_shows_adapter_blocks_as_their_own_state():
    from pagedllm.core.kv_view import ADAPTER, KVView

    scheduler = make_scheduler(SchedulerConfig(max_loras=1, block_size=4), num_blocks=40)
    scheduler.adapters.sizes[1] = 3
    scheduler.add(lora_group("a", 1))
    view = KVView(scheduler)
    scheduler.schedule()
    snap = view.snapshot()
    states = dict(zip(snap.blocks[0::3], snap.blocks[1::3]))
    adapter_blocks = scheduler.block_manager.adapter_blocks[1]
    assert [states[b] for b in adapter_blocks] == [ADAPTER] * 3 and snap.counters.adapter_blocks == 3
    assert any(e.kind == "adapter_load" for e in snap.events)
