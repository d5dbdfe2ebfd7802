"""Which engine replica serves a request: round-robin, least-loaded, or prefix-affinity (plain Python, no torch).

Prefix affinity pays only if the router predicts the replicas' prefix caches, so it keeps, per replica, an index of
the chained block hashes of the prompts it sent there: the same `hash_block` chain the engine's prefix cache uses,
so a match at the router is a hit in the engine. The index is bounded (about a replica's KV pool) and evicts least
recently used blocks first, a prompt's tail before its head, as the engine's pool does. A request goes to the
replica with the longest match unless that replica is overloaded by more than `margin` requests over the
least-loaded one; then, or when nothing matches, the power of two choices (Ray Serve LLM's PrefixCacheAffinityRouter
and SGLang's cache-aware router work the same way).
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pagedllm.core.block_manager import hash_block

ROUTING_POLICIES = ("prefix-affinity", "least-loaded", "round-robin")
DEFAULT_ROUTING_MARGIN = 8  # requests in flight; SGLang's router uses 32 for GPU batches, ours are smaller


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, exactly as BlockManager registers them."""
    hashes: list[int] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


@dataclass
class ReplicaLoad:
    """What the router knows of one replica: health and the requests it has in flight (routed, not finished)."""

    healthy: bool = True
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens the replica has to compute (the router's estimate) + max output tokens
    routed: int = 0  # requests routed here in all


@dataclass
class Route:
    """A routing decision; `matched_blocks` is the prefix the chosen replica is predicted to have cached."""

    replica: int
    matched_blocks: int
    hashes: list[int]
    cost_tokens: int  # what the router added to the replica's queued_tokens (given back by `finish`)


class PrefixIndex:
    """Per replica, a bounded LRU of block hashes; plus who holds each hash, so a match costs O(prompt blocks)
    whatever the number of replicas."""

    def __init__(self, num_replicas: int, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the prefix index needs room for at least one block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.owners: dict[int, set[int]] = {}

    def add_replica(self) -> int:
        """Room for one more replica (a Serve deployment scales up); its slot."""
        self.lru.append(OrderedDict())
        return len(self.lru) - 1

    def insert(self, replica: int, hashes: Sequence[int]) -> None:
        """Touch the prompt's blocks tail first, so its head is the most recent and evicted last."""
        lru = self.lru[replica]
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self.owners.setdefault(h, set()).add(replica)
        while len(lru) > self.capacity:
            self._discard(replica, lru.popitem(last=False)[0])

    def match(self, hashes: Sequence[int], candidates: set[int]) -> tuple[set[int], int]:
        """The candidates holding the longest run of `hashes` from the first, and its length in blocks."""
        best, length = candidates, 0
        for h in hashes:
            holders = best & self.owners.get(h, set())
            if not holders:
                break
            best, length = holders, length + 1
        return (best, length) if length else (set(), 0)

    def clear(self, replica: int) -> None:
        """Forget a replica's blocks (it restarted with an empty cache)."""
        for h in list(self.lru[replica]):
            self._discard(replica, h)
        self.lru[replica].clear()

    def size(self, replica: int) -> int:
        return len(self.lru[replica])

    def _discard(self, replica: int, h: int) -> None:
        holders = self.owners.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.owners[h]


class Router:
    """Routing state shared by the policies: the replicas' loads, health, counters and (for prefix affinity) the
    index. `route` picks a replica and counts the request in flight there; `finish` counts it out."""

    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix-affinity",
                 margin: int = DEFAULT_ROUTING_MARGIN,
                 index_blocks: int = 1 << 16, seed: int = 0) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.policy = policy
        self.block_size = block_size
        self.margin = margin
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.index = PrefixIndex(num_replicas, index_blocks)
        self.rng = random.Random(seed)
        self.turn = itertools.count()
        self.affinity_hits = 0  # requests sent to a replica predicted to hold a prefix of theirs
        self.rerouted = 0  # requests routed again after their replica failed

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def healthy(self, exclude: Collection[int] = ()) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.healthy and i not in exclude]

    def route(self, token_ids: Sequence[int], max_tokens: int = 0, exclude: Collection[int] = ()) -> Route:
        """Choose a healthy replica (not in `exclude`) for this prompt; raises LookupError if there is none."""
        candidates = self.healthy(exclude)
        if not candidates:
            raise LookupError("no healthy replica to route to")
        hashes = block_hashes(token_ids, self.block_size) if self.policy == "prefix-affinity" else []
        replica, matched = self._choose(candidates, hashes)
        if matched:
            self.affinity_hits += 1
        if hashes:
            self.index.insert(replica, hashes)
        cost = len(token_ids) - matched * self.block_size + max_tokens
        load = self.replicas[replica]
        load.in_flight += 1
        load.queued_tokens += cost
        load.routed += 1
        return Route(replica, matched, hashes, cost)

    def finish(self, route: Route) -> None:
        """The request left its replica (finished, aborted or failed)."""
        load = self.replicas[route.replica]
        load.in_flight -= 1
        load.queued_tokens -= route.cost_tokens

    def set_healthy(self, replica: int, healthy: bool, restarted: bool = False) -> None:
        """Health-check result; a restarted replica starts with an empty prefix cache, so its index goes too."""
        self.replicas[replica].healthy = healthy
        if restarted or not healthy:
            self.index.clear(replica)

    # ---- the policies ---------------------------------------------------------------------------------------------
    def _choose(self, candidates: list[int], hashes: list[int]) -> tuple[int, int]:
        if self.policy == "round-robin":
            return candidates[next(self.turn) % len(candidates)], 0
        if self.policy == "least-loaded":
            return self._least_loaded(candidates), 0
        return self._prefix_affinity(candidates, hashes)

    def _least_loaded(self, candidates: list[int]) -> int:
        """Fewest requests in flight; ties go to the smaller index (fewer cached blocks), then at random."""
        return min(candidates, key=lambda i: (self.replicas[i].in_flight, self.index.size(i), self.rng.random()))

    def _power_of_two(self, candidates: list[int]) -> int:
        """The less loaded of two replicas drawn at random: near least-loaded balance without herding."""
        if len(candidates) < 3:
            return self._least_loaded(candidates)
        return self._least_loaded(self.rng.sample(candidates, 2))

    def _prefix_affinity(self, candidates: list[int], hashes: list[int]) -> tuple[int, int]:
        best, matched = self.index.match(hashes, set(candidates))
        if not matched:
            return self._least_loaded(candidates), 0  # a new prefix goes where there is the most room for it
        lightest = min(self.replicas[i].in_flight for i in candidates)
        choice = self._least_loaded(sorted(best))
        if self.replicas[choice].in_flight > lightest + self.margin:
            other = self._power_of_two(candidates)
            return other, matched if other in best else 0
        return choice, matched
