"""Block tables: which physical blocks hold each sequence's tokens, grown a block at a time."""

from __future__ import annotations

from collections import Counter

from pagedllm.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Maps sequence ids to lists of physical blocks; a new block is taken only when the last one is full."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def new_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks to take so that the sequence's table covers `num_tokens` tokens."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.new_blocks_needed(seq_id, num_tokens) <= self.pool.num_free

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Grow the sequence's table to cover `num_tokens` tokens (a prompt chunk or a decode token)."""
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(self.new_blocks_needed(seq_id, num_tokens)):
            table.append(self.pool.take())

    def append_slot(self, seq_id: str, num_tokens: int) -> None:
        """Room for one more token after `num_tokens - 1` stored ones (decode)."""
        self.allocate(seq_id, num_tokens)

    def free(self, seq_id: str) -> None:
        """Return every block of the sequence; tail first, so the free list reuses hot blocks last."""
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self.pool.release(block_id)

    def slot(self, seq_id: str, position: int) -> int:
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def check(self) -> None:
        """DESIGN.md's invariants: each ref count equals the number of tables holding the block."""
        self.pool.check()
        holders = Counter(b for table in self.block_tables.values() for b in table)
        for block_id, rc in enumerate(self.pool.ref_counts):
            assert rc == holders.get(block_id, 0), f"block {block_id}: ref count {rc}, held {holders[block_id]}"
