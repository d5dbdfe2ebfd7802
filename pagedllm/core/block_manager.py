"""Block tables: which physical blocks hold each sequence's tokens; sharing, copy-on-write and the prefix cache."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_events import KVRecorder
from pagedllm.core.kv_tier import PrefixTier, TierBlock, chain_digest


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """A full block's identity, chained with its parent's so equal hashes mean equal prefixes (collisions aside)."""
    return hash((parent_hash, tokens))


def root(lora_int_id: int) -> tuple[int | None, int]:
    """The (hash, content id) a first block is chained to: the adapter's own, so that sequences of two adapters (or
    of one and the base model) never share K/V; content ids of real blocks are >= 0."""
    return (None, -1) if lora_int_id == 0 else (hash(("lora", lora_int_id)), -1 - lora_int_id)


@dataclass
class Prefix:
    """The cached full blocks a new sequence can start from, and their hashes; then the blocks after them that the
    second tier holds (restored into fresh blocks when the sequence starts)."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    restore: list[TierBlock] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.restore)


@dataclass
class Write:
    """A sequence about to compute tokens [start, end); `prefix` only for a sequence that has no table yet."""

    seq_id: Hashable
    start: int
    end: int
    prefix: Prefix = field(default_factory=Prefix)


class BlockManager:
    """Maps sequence ids to lists of physical blocks; a new block is taken only when the last one is full."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recorder = KVRecorder()  # what happens to the blocks, for kv_view (a dashboard, a trace)
        self.pool = BlockPool(num_blocks, self.recorder)
        self.block_tables: dict[Hashable, list[int]] = {}
        self.block_hashes: dict[Hashable, list[int]] = {}  # hashes of the table's registered full blocks
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) pairs not yet handed to the runner
        self.num_cow_copies = 0
        self.prefix_cache_queries = 0  # tokens of new sequences looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found there
        self.tier: PrefixTier | None = None  # the second tier (core/kv_tier.py), set by the engine
        self.tier_hits = 0  # full blocks of new sequences restored from the tier
        self.tier_misses = 0  # full blocks of new sequences found in neither the pool nor the tier
        self.adapter_blocks: dict[int, list[int]] = {}  # resident LoRA adapter -> the blocks its weights count as

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def has_table(self, seq_id: Hashable) -> bool:
        return seq_id in self.block_tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's physical blocks in logical order (the live list: read it, do not change it)."""
        return self.block_tables[seq_id]

    # ---- prefix cache -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], lora_int_id: int = 0) -> Prefix:
        """The longest run of cached full blocks of `token_ids` (computed with that adapter), leaving at least the
        last token to compute: those in the pool, then those the second tier holds (checked by name, nothing read;
        the base model's blocks only: an adapter's id names nothing that outlives the process)."""
        prefix = Prefix()
        if not self.enable_prefix_caching:
            return prefix
        bs, (parent_hash, parent_cid), digest = self.block_size, root(lora_int_id), b""
        tier = self.tier if lora_int_id == 0 else None
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = hash_block(parent_hash, tokens)
            block_id = None if prefix.restore else self.pool.lookup(block_hash, (parent_cid, tokens))
            if block_id is not None:
                prefix.blocks.append(block_id)
                prefix.hashes.append(block_hash)
                parent_cid, digest = self.pool.contents[block_id].cid, self.pool.contents[block_id].digest
            elif tier is not None and tier.contains(digest := chain_digest(digest, tokens)):
                prefix.restore.append(TierBlock(block_hash, tokens, digest))
            else:
                break
            parent_hash = block_hash
        return prefix

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int,
                          lora_int_id: int = 0) -> None:
        """Register the blocks that the last step filled, so later sequences (of the same adapter) can find them."""
        if not self.enable_prefix_caching:
            return
        table, hashes, bs = self.block_tables[seq_id], self.block_hashes.setdefault(seq_id, []), self.block_size
        root_hash, root_cid = root(lora_int_id)
        for i in range(len(hashes), num_computed // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = hash_block(hashes[-1] if hashes else root_hash, tokens)
            parent = self.pool.contents[table[i - 1]] if i else None
            tiered = self.tier is not None and lora_int_id == 0  # an adapter's blocks never go to the tier
            digest = chain_digest(parent.digest if parent else b"", tokens) if tiered else b""
            self.pool.register(table[i], block_hash, (parent.cid if parent else root_cid, tokens), digest)
            hashes.append(block_hash)

    # ---- allocation -------------------------------------------------------------------------------
    def blocks_needed(self, writes: list[Write]) -> int:
        """Free blocks that `allocate` will consume for these writes: new blocks, revived cached blocks, copies."""
        revived = {b for w in writes for b in w.prefix.blocks if self.pool.ref_counts[b] == 0}
        grow = sum(max(0, blocks_for(w.end, self.block_size) - len(self.block_tables.get(w.seq_id) or w.prefix.blocks))
                   for w in writes)
        shared = Counter(b for w in writes if (b := self._written_block(w.seq_id, w.start)) is not None
                         and self.pool.ref_counts[b] > 1)
        copies = sum(k - (self.pool.ref_counts[b] == k) for b, k in shared.items())  # the last sharer writes in place
        return len(revived) + grow + copies

    def can_allocate(self, seq_id: Hashable, num_tokens: int, start: int = 0) -> bool:
        return self.blocks_needed([Write(seq_id, start, num_tokens)]) <= self.pool.num_free

    def share_prefix(self, seq_id: Hashable, prefix: Prefix, num_tokens: int) -> int:
        """Start a new sequence of `num_tokens` tokens with its cached blocks (one more reference each) and the
        blocks restored from the second tier; the tokens it starts with (fewer than the prefix's if a read failed)."""
        assert seq_id not in self.block_tables
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += len(prefix.blocks) * self.block_size
            if prefix.blocks:
                self.recorder.record("prefix_hit", seq_id, blocks=tuple(prefix.blocks),
                                     tokens=len(prefix.blocks) * self.block_size)
        for block_id in prefix.blocks:
            self.pool.incref(block_id)
        self.block_tables[seq_id] = list(prefix.blocks)
        self.block_hashes[seq_id] = list(prefix.hashes)
        if self.tier is not None and self.enable_prefix_caching:
            restored = self._restore(seq_id, prefix.restore) if prefix.restore else 0
            self.tier_hits += restored
            self.tier_misses += (num_tokens - 1) // self.block_size - len(prefix.blocks) - restored
        return len(self.block_tables[seq_id]) * self.block_size

    def _restore(self, seq_id: Hashable, wanted: list[TierBlock]) -> int:
        """Fresh blocks (taken after the shared ones, so they cannot evict them) filled by the tier and registered as
        the table's next blocks; those whose read failed go back to the pool. How many were restored."""
        table, hashes = self.block_tables[seq_id], self.block_hashes[seq_id]
        taken = [self.pool.take() for _ in wanted]
        assert self.tier is not None
        restored = self.tier.restore(list(zip(taken, wanted)))
        for block_id in taken[restored:]:
            self.pool.release(block_id)
        for block_id, block in zip(taken, wanted[:restored]):
            parent_cid = self.pool.contents[table[-1]].cid if table else -1
            self.pool.register(block_id, block.hash, (parent_cid, block.tokens), block.digest, restored=True)
            table.append(block_id)
            hashes.append(block.hash)
        if restored:
            self.recorder.record("restore", seq_id, blocks=tuple(taken[:restored]), tokens=restored * self.block_size)
        return restored

    def allocate(self, seq_id: Hashable, num_tokens: int, start: int = 0) -> None:
        """Make tokens [start, num_tokens) writable: grow the table, and copy a shared block written into."""
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(blocks_for(num_tokens, self.block_size) - len(table)):
            table.append(self.pool.take())
        self.copy_on_write(seq_id, start)

    def append_slot(self, seq_id: Hashable, num_tokens: int) -> None:
        """Room for one more token after `num_tokens - 1` stored ones (decode)."""
        self.allocate(seq_id, num_tokens, num_tokens - 1)

    def copy_on_write(self, seq_id: Hashable, position: int) -> None:
        """Before a write at `position` into a block others share, give this sequence its own copy."""
        src = self._written_block(seq_id, position)
        if src is None or self.pool.ref_counts[src] == 1:
            return
        dst = self.pool.take()
        self.pool.release(src)
        self.block_tables[seq_id][position // self.block_size] = dst
        self.copies.append((src, dst))
        self.num_cow_copies += 1
        self.recorder.record("cow", seq_id, blocks=(src, dst))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent."""
        table = self.block_tables[parent_id]
        for block_id in table:
            self.pool.incref(block_id)
        self.block_tables[child_id] = list(table)
        self.block_hashes[child_id] = list(self.block_hashes.get(parent_id, []))
        self.recorder.record("fork", child_id, blocks=tuple(table))

    def free(self, seq_id: Hashable) -> None:
        """Return every block of the sequence; tail first, so the LRU evicts a sequence's tail before its head. The
        second tier gets the registered blocks no one holds any more (head first)."""
        self.block_hashes.pop(seq_id, None)
        table = self.block_tables.pop(seq_id, [])
        for block_id in reversed(table):
            self.pool.release(block_id)
        if self.tier is not None:
            let_go = [(b, c.digest, c.key[1]) for b in table
                      if self.pool.ref_counts[b] == 0 and (c := self.pool.contents.get(b)) is not None and c.digest]
            if let_go:
                self.tier.offload(let_go)

    # ---- LoRA adapters in the pool (S-LoRA's unified paging) ---------------------------------------------------------
    def hold_adapter(self, lora_int_id: int, num_blocks: int) -> None:
        """A resident adapter's weights take `num_blocks` of the pool (the KV cache has that much less)."""
        blocks = [self.pool.take() for _ in range(num_blocks)]
        self.adapter_blocks[lora_int_id] = blocks
        self.recorder.record("adapter_load", lora_int_id, blocks=tuple(blocks))

    def release_adapter(self, lora_int_id: int) -> None:
        """An evicted adapter's blocks go back to the pool."""
        blocks = self.adapter_blocks.pop(lora_int_id, [])
        for block_id in blocks:
            self.pool.release(block_id)
        self.recorder.record("adapter_evict", lora_int_id, blocks=tuple(blocks))

    @property
    def num_adapter_blocks(self) -> int:
        return sum(map(len, self.adapter_blocks.values()))

    def take_copies(self) -> list[tuple[int, int]]:
        """This step's block copies, for the model runner to perform before the forward."""
        copies, self.copies = self.copies, []
        return copies

    def slot(self, seq_id: Hashable, position: int) -> int:
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _written_block(self, seq_id: Hashable, position: int) -> int | None:
        """The existing block a write at `position` lands in (None if it needs a new block)."""
        table = self.block_tables.get(seq_id, [])
        index = position // self.block_size
        return table[index] if index < len(table) else None

    def check(self) -> None:
        """DESIGN.md's invariants: each ref count equals the number of tables holding the block."""
        self.pool.check()
        holders = Counter(b for table in (*self.block_tables.values(), *self.adapter_blocks.values()) for b in table)
        for block_id, rc in enumerate(self.pool.ref_counts):
            assert rc == holders.get(block_id, 0), f"block {block_id}: ref count {rc}, held {holders[block_id]}"
