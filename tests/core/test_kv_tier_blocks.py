"""The second tier as the block manager and scheduler see it, with a fake tier (no model, no files): blocks let go
are offered head first, a prefix the pool lost is restored after the pool's own blocks and counts as computed, a
failed read starts the sequence where the restore stopped, and the KV view marks restored blocks."""

from __future__ import annotations

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_tier import TierBlock, chain_digest
from pagedllm.core.kv_view import RESTORED, STATE_NAMES, KVView
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams

BS = 4


class FakeTier:
    """Keeps the digests offered; restores them (all, or up to the first in `broken`)."""

    def __init__(self) -> None:
        self.stored: dict[bytes, tuple[int, ...]] = {}
        self.offered: list[list[int]] = []  # pool blocks per offload call
        self.restored: list[int] = []
        self.broken: set[bytes] = set()

    def contains(self, digest: bytes) -> bool:
        return digest in self.stored

    def offload(self, blocks: list[tuple[int, bytes, tuple[int, ...]]]) -> None:
        self.offered.append([b for b, _, _ in blocks])
        self.stored.update((digest, tokens) for _, digest, tokens in blocks)

    def restore(self, blocks: list[tuple[int, TierBlock]]) -> int:
        done = 0
        for block_id, block in blocks:
            if block.digest in self.broken or self.stored.get(block.digest) != block.tokens:
                break
            self.restored.append(block_id)
            done += 1
        return done


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(max_tokens=4), RequestMetrics(0.0), max_tokens=4)


def run_prompt(sched: Scheduler, s: Sequence) -> None:
    """Prefill the whole prompt in one step, then let the sequence go."""
    sched.add(SequenceGroup.make(s))
    plan = sched.schedule()
    sched.commit(plan)
    s.finish("length")
    sched.finish(sched.running[0])


def setup(num_blocks: int = 16) -> tuple[BlockManager, Scheduler, FakeTier]:
    bm = BlockManager(num_blocks, BS)
    bm.tier = tier = FakeTier()
    return bm, Scheduler(bm, 8, 256), tier


PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens


def test_digests_chain_like_the_prefix():
    a = chain_digest(b"", (1, 2, 3, 4))
    assert a == chain_digest(b"", (1, 2, 3, 4)) and len(a) == 16
    assert chain_digest(a, (5, 6, 7, 8)) != chain_digest(chain_digest(b"", (1, 2, 3, 9)), (5, 6, 7, 8))


def test_blocks_let_go_are_offered_head_first_once_no_one_holds_them():
    bm, sched, tier = setup()
    run_prompt(sched, seq("a", PROMPT))
    table_digests = [bm.pool.contents[b].digest for b in tier.offered[0]]
    assert len(tier.offered) == 1 and len(tier.offered[0]) == 4  # the partial last block is not registered
    assert table_digests[0] == chain_digest(b"", tuple(PROMPT[:4]))
    assert table_digests[1] == chain_digest(table_digests[0], tuple(PROMPT[4:8]))


def test_a_prefix_the_pool_lost_is_restored_and_counts_as_computed():
    bm, sched, tier = setup()
    run_prompt(sched, seq("a", PROMPT))
    bm.pool.evict_cached_free()  # the pool forgets; the tier still has the 4 blocks
    again = seq("b", PROMPT + [7, 7])
    sched.add(SequenceGroup.make(again))
    plan = sched.schedule()
    (s,) = plan.scheduled
    assert s.start == 16 and s.num_new_tokens == 4  # 4 blocks restored: only the rest is computed
    assert tier.restored == bm.block_table(again.seq_id)[:4]
    assert bm.tier_hits == 4 and bm.tier_misses == 4  # the first prompt found none
    assert all(bm.pool.contents[b].restored for b in tier.restored)
    assert bm.match_prefix(PROMPT + [1]).blocks == tier.restored  # registered: the pool finds them now
    states = KVView(sched).snapshot().blocks
    assert {states[i + 1] for i in range(0, len(states), 3) if states[i] in tier.restored} == {RESTORED}
    assert STATE_NAMES[RESTORED] == "restored"
    sched.commit(plan)
    bm.check()


def test_restore_follows_the_blocks_the_pool_still_has():
    bm, sched, tier = setup()
    run_prompt(sched, seq("a", PROMPT))
    head = bm.match_prefix(PROMPT).blocks[:2]
    for b in bm.match_prefix(PROMPT).blocks[2:]:  # the pool keeps the first 2 blocks only
        bm.pool._forget(b)
        bm.pool.free.move_to_end(b, last=False)
    prefix = bm.match_prefix(PROMPT + [1])
    assert prefix.blocks == head and len(prefix.restore) == 2 and prefix.num_blocks == 4
    bm.check()


def test_a_failed_read_starts_the_sequence_where_the_restore_stopped():
    bm, sched, tier = setup()
    run_prompt(sched, seq("a", PROMPT))
    digests = [bm.pool.contents[b].digest for b in tier.offered[0]]
    bm.pool.evict_cached_free()
    tier.broken = {digests[2]}
    again = seq("b", PROMPT + [7, 7])
    sched.add(SequenceGroup.make(again))
    plan = sched.schedule()
    (s,) = plan.scheduled
    assert s.start == 8 and s.num_new_tokens == 4  # 2 restored; the planned chunk computed from there instead
    assert again.num_computed_tokens == 8 and len(bm.block_table(again.seq_id)) == 3
    assert bm.tier_hits == 2 and bm.tier_misses == 4 + 2
    assert bm.num_free_blocks == 16 - 3  # the blocks the failed reads took went back
    sched.commit(plan)
    while again.num_computed_tokens < again.num_tokens:  # the rest of the prompt in the next steps
        sched.commit(sched.schedule())
        bm.check()
    assert len(bm.block_table(again.seq_id)) == 5


def test_without_a_tier_nothing_changes():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, 8, 256)
    run_prompt(sched, seq("a", PROMPT))
    assert all(c.digest == b"" and not c.restored for c in bm.pool.contents.values())
    bm.pool.evict_cached_free()
    assert bm.match_prefix(PROMPT).num_blocks == 0
