"""The pool of physical KV blocks: a free list and reference counts, nothing else (no torch)."""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is taken from an empty pool; the scheduler checks first, so this is a bug."""


class BlockPool:
    """Hands out physical block ids; a block returns to the free list when its last holder lets go."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def take(self) -> int:
        """A fresh block with one reference."""
        if not self.free_ids:
            raise NoFreeBlocksError("the KV block pool is empty")
        block_id = self.free_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"block {block_id} is free"
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; the block is free again when none is left."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} released twice"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_ids.append(block_id)

    def check(self) -> None:
        """The pool's invariants: free and referenced blocks partition the pool."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        referenced = {b for b, rc in enumerate(self.ref_counts) if rc > 0}
        assert not free & referenced, "a free block is referenced"
        assert len(free) + len(referenced) == self.num_blocks, "a block is neither free nor referenced"
