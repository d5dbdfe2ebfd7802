"""The router's policies and its prefix index, without Ray or a model: the hashes are the block manager's, matches
follow the chain, the index stays bounded and evicts a prompt's tail first, load and health steer the choice."""

from __future__ import annotations

import random

import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.engine.router import PrefixIndex, Router, block_hashes

BS = 4


def prompt(prefix: int, length: int, tail: int = 0) -> list[int]:
    """`length` tokens: a run determined by `prefix`, the last `tail` of them distinct per call."""
    rng = random.Random(prefix)
    ids = [rng.randrange(1000) for _ in range(length - tail)]
    return ids + [random.randrange(1000, 2000) for _ in range(tail)]


def test_block_hashes_are_the_block_managers():
    """A prefix the router indexed is the prefix the engine's cache finds (same chained hashes)."""
    ids = prompt(1, 4 * BS + 2)
    bm = BlockManager(16, BS)
    bm.allocate("s", len(ids))
    bm.cache_full_blocks("s", ids, len(ids))
    assert block_hashes(ids, BS) == bm.block_hashes["s"]
    assert bm.match_prefix(ids + [5]).hashes == block_hashes(ids, BS)


def test_index_matches_the_longest_chain_and_only_candidates():
    index = PrefixIndex(3, capacity_blocks=100)
    a, b = block_hashes(prompt(1, 8 * BS), BS), block_hashes(prompt(2, 8 * BS), BS)
    index.insert(0, a[:3])
    index.insert(1, a[:6])
    index.insert(2, b)
    assert index.match(a, {0, 1, 2}) == ({1}, 6)
    assert index.match(a, {0, 2}) == ({0}, 3)
    assert index.match(a[:2], {0, 1, 2}) == ({0, 1}, 2)
    assert index.match(block_hashes(prompt(3, 8 * BS), BS), {0, 1, 2}) == (set(), 0)


def test_index_is_bounded_and_evicts_tails_first():
    index = PrefixIndex(1, capacity_blocks=6)
    old, new = block_hashes(prompt(1, 4 * BS), BS), block_hashes(prompt(2, 4 * BS), BS)
    index.insert(0, old)
    index.insert(0, new)
    assert index.size(0) == 6
    assert index.match(old, {0}) == ({0}, 2)  # the old prompt lost its two last blocks, kept its head
    assert index.match(new, {0}) == ({0}, 4)
    index.clear(0)
    assert index.size(0) == 0 and not index.owners


def test_prefix_affinity_sends_a_shared_prefix_to_one_replica():
    router = Router(4, BS, "prefix-affinity", margin=100)
    routes = [router.route(prompt(7, 10 * BS, tail=BS)) for _ in range(20)]
    assert len({r.replica for r in routes}) == 1
    assert router.affinity_hits == 19 and all(r.matched_blocks >= 9 for r in routes[1:])


def test_distinct_prefixes_spread_over_replicas():
    router = Router(4, BS, "prefix-affinity")
    replicas = {router.route(prompt(p, 8 * BS)).replica for p in range(4)}
    assert replicas == {0, 1, 2, 3}  # nothing matches: the least loaded takes each new prefix


def test_an_overloaded_replica_sheds_its_prefix():
    router = Router(4, BS, "prefix-affinity", margin=2)
    first = router.route(prompt(7, 8 * BS))
    routes = [router.route(prompt(7, 8 * BS)) for _ in range(12)]
    counts = [r.in_flight for r in router.replicas]
    assert counts[first.replica] <= min(counts) + 2 + 1
    assert len({r.replica for r in routes}) > 1
    for r in [first, *routes]:
        router.finish(r)
    assert all(r.in_flight == 0 and r.queued_tokens == 0 for r in router.replicas)


def test_least_loaded_and_round_robin():
    router = Router(3, BS, "least-loaded")
    held = [router.route(prompt(1, 2 * BS)) for _ in range(6)]
    assert [r.in_flight for r in router.replicas] == [2, 2, 2]
    router.finish(held[0])
    assert router.route(prompt(1, 2 * BS)).replica == held[0].replica
    rr = Router(3, BS, "round-robin")
    assert [rr.route(prompt(1, 2 * BS)).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("policy", ["prefix-affinity", "least-loaded", "round-robin"])
def test_unhealthy_and_excluded_replicas_get_nothing(policy):
    router = Router(3, BS, policy)
    router.set_healthy(1, False)
    chosen = {router.route(prompt(p, 4 * BS), exclude={2}).replica for p in range(10)}
    assert chosen == {0}
    router.set_healthy(0, False)
    with pytest.raises(LookupError):
        router.route(prompt(1, 4 * BS), exclude={2})


def test_a_restarted_replica_loses_its_index():
    router = Router(2, BS, "prefix-affinity", margin=100)
    first = router.route(prompt(7, 8 * BS))
    router.set_healthy(first.replica, True, restarted=True)
    assert router.index.size(first.replica) == 0
    assert router.route(prompt(7, 8 * BS)).matched_blocks == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        Router(2, BS, "random")
    with pytest.raises(ValueError):
        Router(0, BS)
    with pytest.raises(ValueError):
        PrefixIndex(2, 0)
