"""Block tables: which physical blocks hold each sequence's tokens; sharing, copy-on-write and the prefix cache."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from pagedllm.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def reservation_tokens(policy: str, num_prompt_tokens: int, max_tokens: int, limit: int) -> int:
    """Slots a contiguous KV allocator sets aside for a sequence at admission, as the vLLM paper's Orca baselines
    (section 6.1): reserve-max the longest sequence allowed, reserve-pow2 the prompt plus the output length rounded up
    to a power of two (the output over-reserved by at most 2x), reserve-oracle the exact final length. `max_tokens`
    stands for the true output length: it is, when a benchmark sets it so and runs with ignore_eos. At most `limit`."""
    if policy == "reserve-max":
        return limit
    if policy == "reserve-pow2":
        return min(limit, num_prompt_tokens + (1 << (max_tokens - 1).bit_length()))
    if policy == "reserve-oracle":
        return min(limit, num_prompt_tokens + max_tokens)
    raise ValueError(f"no reservation under kv_policy {policy!r}")


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """A full block's identity, chained with its parent's so equal hashes mean equal prefixes (collisions aside)."""
    return hash((parent_hash, tokens))


@dataclass
class Prefix:
    """The cached full blocks a new sequence can start from, and their hashes."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


@dataclass
class Write:
    """A sequence about to compute tokens [start, end); `prefix` only for a sequence that has no table yet."""

    seq_id: Hashable
    start: int
    end: int
    prefix: Prefix = field(default_factory=Prefix)


@dataclass
class KVUsage:
    """KV token slots held (blocks held by running sequences x block size; a shared block once) and tokens stored in
    them, at the last step and summed over steps: the waste fraction of a run is 1 - stored_sum / held_sum."""

    kv_slots_held: int = 0
    kv_tokens_stored: int = 0
    kv_slots_held_sum: int = 0
    kv_tokens_stored_sum: int = 0
    kv_steps: int = 0
    peak_num_running: int = 0  # most sequences running in one step

    def record(self, held: int, stored: int, num_running: int) -> None:
        self.kv_slots_held, self.kv_tokens_stored = held, stored
        self.kv_slots_held_sum += held
        self.kv_tokens_stored_sum += stored
        self.kv_steps += 1
        self.peak_num_running = max(self.peak_num_running, num_running)


class BlockManager:
    """Maps sequence ids to lists of physical blocks; a new block is taken only when the last one is full."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[Hashable, list[int]] = {}
        self.block_hashes: dict[Hashable, list[int]] = {}  # hashes of the table's registered full blocks
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) pairs not yet handed to the runner
        self.next_copies: list[tuple[int, int]] = []  # pairs for the step after the one being scheduled
        self.num_cow_copies = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    # ---- prefix cache -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> Prefix:
        """The longest run of cached full blocks of `token_ids`, leaving at least the last token to compute."""
        prefix = Prefix()
        if not self.enable_prefix_caching:
            return prefix
        bs, parent_hash, parent_cid = self.block_size, None, -1
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = hash_block(parent_hash, tokens)
            block_id = self.pool.lookup(block_hash, (parent_cid, tokens))
            if block_id is None:
                break
            prefix.blocks.append(block_id)
            prefix.hashes.append(block_hash)
            parent_hash, parent_cid = block_hash, self.pool.contents[block_id].cid
        return prefix

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the blocks that the last step filled, so later sequences can find them."""
        if not self.enable_prefix_caching:
            return
        table, hashes, bs = self.block_tables[seq_id], self.block_hashes.setdefault(seq_id, []), self.block_size
        for i in range(len(hashes), num_computed // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = hash_block(hashes[-1] if hashes else None, tokens)
            parent_cid = self.pool.contents[table[i - 1]].cid if i else -1
            self.pool.register(table[i], block_hash, (parent_cid, tokens))
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

    def share_prefix(self, seq_id: Hashable, prefix: Prefix) -> None:
        """Start a new sequence's table with cached blocks (one more reference each)."""
        assert seq_id not in self.block_tables
        for block_id in prefix.blocks:
            self.pool.incref(block_id)
        self.block_tables[seq_id] = list(prefix.blocks)
        self.block_hashes[seq_id] = list(prefix.hashes)

    def allocate(self, seq_id: Hashable, num_tokens: int, start: int = 0) -> None:
        """Make tokens [start, num_tokens) writable: grow the table, and copy a shared block written into."""
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(blocks_for(num_tokens, self.block_size) - len(table)):
            table.append(self.pool.take())
        self.copy_on_write(seq_id, start)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """A reservation policy's table: every block the sequence may ever need, taken now (so it never grows)."""
        assert seq_id not in self.block_tables
        self.block_tables[seq_id] = [self.pool.take() for _ in range(blocks_for(num_tokens, self.block_size))]

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

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent."""
        table = self.block_tables[parent_id]
        for block_id in table:
            self.pool.incref(block_id)
        self.block_tables[child_id] = list(table)
        self.block_hashes[child_id] = list(self.block_hashes.get(parent_id, []))

    def copy_into_reservation(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """A sample with its own reservation gets its own copy of the parent's first `num_tokens` tokens (nothing is
        shared). The copy runs before the next step, as the step being scheduled still writes the parent's last
        prompt chunk; should the child's blocks be freed meanwhile, their next holder writes them after the copy."""
        n = blocks_for(num_tokens, self.block_size)
        self.next_copies += zip(self.block_tables[parent_id][:n], self.block_tables[child_id][:n])

    def free(self, seq_id: Hashable) -> None:
        """Return every block of the sequence; tail first, so the LRU evicts a sequence's tail before its head."""
        self.block_hashes.pop(seq_id, None)
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self.pool.release(block_id)

    def take_copies(self) -> list[tuple[int, int]]:
        """This step's block copies, for the model runner to perform before the forward."""
        copies, self.copies, self.next_copies = self.copies, self.next_copies, []
        return copies

    def slot(self, seq_id: Hashable, position: int) -> int:
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def kv_slots_and_tokens(self, num_stored: Mapping[Hashable, int]) -> tuple[int, int]:
        """Token slots of the held blocks and the tokens stored in them, a shared block counted once, given the
        tokens each sequence stores (none if missing). Only a table's last filled block can be partial (a shared one
        alike in every sharer) and only a reservation has blocks past it, so one look per table suffices."""
        bs, unused, tails = self.block_size, 0, {}
        for seq_id, table in self.block_tables.items():
            full, part = divmod(num_stored.get(seq_id, 0), bs)
            unused += len(table) - full - (part > 0)
            if part:
                tails[table[full]] = bs - part
        held = self.pool.num_used * bs
        return held, held - unused * bs - sum(tails.values())

    def _written_block(self, seq_id: Hashable, position: int) -> int | None:
        """The existing block a write at `position` lands in (None if it needs a new block)."""
        table = self.block_tables.get(seq_id, [])
        index = position // self.block_size
        return table[index] if index < len(table) else None

    def check(self) -> None:
        """DESIGN.md's invariants: each ref count equals the number of tables holding the block."""
        self.pool.check()
        holders = Counter(b for table in self.block_tables.values() for b in table)
        for block_id, rc in enumerate(self.pool.ref_counts):
            assert rc == holders.get(block_id, 0), f"block {block_id}: ref count {rc}, held {holders[block_id]}"
