"""The pool of physical KV blocks: ref counts, free blocks in eviction order, and the prefix cache (no torch).

A full block can be *registered*: it then keeps its hash and contents after its last holder lets go, and stays
findable until the pool needs it (least recently freed first). Cached-but-free blocks count as free.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.core.kv_events import KVRecorder


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is taken from an empty pool; the scheduler checks first, so this is a bug."""


@dataclass(frozen=True)
class BlockContent:
    """What a registered block holds: `key` is compared on every hit, so a hash collision never matches."""

    hash: int
    key: tuple[int, tuple[int, ...]]  # (content id of the parent block, -1 for the first; this block's tokens)
    cid: int  # names this exact prefix: equal for two blocks only if their whole prefixes are equal
    digest: bytes = b""  # its name in the second tier (core/kv_tier.chain_digest), when there is one
    restored: bool = False  # its K/V came back from the second tier, not from a forward


class BlockPool:
    """Hands out block ids; a block is free when no table holds it, and evicted only when taken again."""

    def __init__(self, num_blocks: int, recorder: KVRecorder | None = None) -> None:
        self.num_blocks = num_blocks
        self.recorder = recorder or KVRecorder()  # every change of a block's ref count or cached state
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # first out first
        self.cached: dict[int, int] = {}  # hash -> block
        self.contents: dict[int, BlockContent] = {}  # block -> its registered contents
        self._cids = itertools.count()
        self.num_evictions = 0
        self.num_cached_free = 0  # free blocks that still hold a registered prefix (kept as a count: read every step)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def take(self) -> int:
        """A fresh block with one reference: the front of the free list, its cached contents evicted."""
        if not self.free:
            raise NoFreeBlocksError("the KV block pool is empty")
        block_id, _ = self.free.popitem(last=False)
        if block_id in self.contents:
            self.num_evictions += 1
            self.recorder.record("evict", blocks=(block_id,))
            self._forget(block_id)
        self.ref_counts[block_id] = 1
        self.recorder.changed(block_id)
        return block_id

    def evict_cached_free(self) -> None:
        """Empty the prefix cache of every free block (blocks in use keep theirs): vLLM's reset_prefix_cache."""
        evicted = [b for b in self.free if b in self.contents]
        for block_id in evicted:
            self._forget(block_id)
            self.free.move_to_end(block_id, last=False)
            self.recorder.changed(block_id)
        self.recorder.record("reset", blocks=tuple(evicted))

    def _forget(self, block_id: int) -> None:
        """A free block's registered contents go: it is no longer found by its hash."""
        content = self.contents.pop(block_id)
        self.num_cached_free -= 1
        if self.cached.get(content.hash) == block_id:
            del self.cached[content.hash]

    def incref(self, block_id: int) -> None:
        """One more holder; a cached-but-free block comes back to life."""
        if self.ref_counts[block_id] == 0:
            assert block_id in self.contents, f"block {block_id} is free and holds nothing"
            del self.free[block_id]
            self.num_cached_free -= 1
        self.ref_counts[block_id] += 1
        self.recorder.changed(block_id)

    def release(self, block_id: int) -> None:
        """Drop one reference; when none is left the block is free: last in line if cached, else first."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} released twice"
        self.ref_counts[block_id] -= 1
        self.recorder.changed(block_id)
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None
            if block_id in self.contents:
                self.num_cached_free += 1
            else:
                self.free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: int, key: tuple[int, tuple[int, ...]]) -> int | None:
        """The cached block with this hash, if its contents really are `key`."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.contents[block_id].key != key:
            return None
        return block_id

    def register(self, block_id: int, block_hash: int, key: tuple[int, tuple[int, ...]], digest: bytes = b"",
                 restored: bool = False) -> int:
        """Record a block that just became full; returns its content id. The first block with a hash stays
        the one found (a twin gets the same content id, so its children can be registered too)."""
        if block_id not in self.contents:
            twin = self.lookup(block_hash, key)
            cid = next(self._cids) if twin is None else self.contents[twin].cid
            self.contents[block_id] = BlockContent(block_hash, key, cid, digest, restored)
            self.cached.setdefault(block_hash, block_id)
        return self.contents[block_id].cid

    def check(self) -> None:
        """The pool's invariants: free and referenced blocks partition the pool; the hash map is consistent."""
        referenced = {b for b, rc in enumerate(self.ref_counts) if rc > 0}
        assert not set(self.free) & referenced, "a free block is referenced"
        assert len(self.free) + len(referenced) == self.num_blocks, "a block is neither free nor referenced"
        assert self.num_cached_free == sum(b in self.contents for b in self.free), "cached-free count is off"
        for block_hash, block_id in self.cached.items():
            assert self.contents[block_id].hash == block_hash, f"block {block_id} is cached under a wrong hash"
