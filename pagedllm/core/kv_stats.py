"""KV waste accounting, as the vLLM paper measures it: token slots held by running sequences vs tokens stored."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import SequenceGroup


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

    def record_step(self, block_manager: BlockManager, running: Iterable[SequenceGroup]) -> None:
        """After a step's commit: O(running sequences)."""
        live = [s for g in running for s in g.seqs if not s.is_finished]
        held, stored = slots_and_tokens(block_manager, {s.seq_id: s.num_computed_tokens for s in live})
        self.kv_slots_held, self.kv_tokens_stored = held, stored
        self.kv_slots_held_sum += held
        self.kv_tokens_stored_sum += stored
        self.kv_steps += 1
        self.peak_num_running = max(self.peak_num_running, len(live))


def slots_and_tokens(bm: BlockManager, num_stored: Mapping[Hashable, int]) -> tuple[int, int]:
    """Token slots of the held blocks and the tokens stored in them, a shared block counted once, given the tokens
    each sequence stores (none if missing). Only a table's last filled block can be partial (a shared one alike in
    every sharer) and only a reservation has blocks past it, so one look per table suffices."""
    bs, unused, tails = bm.block_size, 0, {}
    for seq_id, table in bm.block_tables.items():
        full, part = divmod(num_stored.get(seq_id, 0), bs)
        unused += len(table) - full - (part > 0)
        if part:
            tails[table[full]] = bs - part
    held = (bm.pool.num_used - bm.num_adapter_blocks) * bs  # LoRA adapters' blocks hold no token slots
    return held, held - unused * bs - sum(tails.values())


@dataclass
class EngineCounters:
    """What the engine did with its KV blocks so far (prefix cache figures are in tokens)."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    blocks_in_use: int
    blocks_cached_free: int
    num_total_blocks: int
    cow_copies: int
    preemptions: int
    kv_slots_held: int  # last step: KV token slots in blocks held by running sequences (a shared block once)
    kv_tokens_stored: int  # last step: tokens stored in them
    kv_slots_held_sum: int  # summed over steps
    kv_tokens_stored_sum: int
    kv_steps: int  # steps summed
    peak_num_running: int  # most sequences running in one step
    spec_draft_tokens: int = 0  # speculative decoding: proposed tokens verified, and those accepted
    spec_accepted_tokens: int = 0
    spec_gate: list[dict[str, object]] = field(default_factory=list)  # what the speculation gate measured per bucket
    # the prefix cache's second tier (--kv-offload-dir), empty without one: blocks restored (hits) and not found
    # (misses), bytes read and written, restore time, writes dropped (engine/kv_offload.py's KVTier.stats)
    kv_tier: dict[str, float] = field(default_factory=dict)
    lora_adapters_loaded: int = 0  # LoRA adapters registered (loaded from disk)
    lora_adapters_resident: int = 0  # of those, holding a slot and blocks of the pool
    lora_adapter_blocks: int = 0  # pool blocks the resident adapters' weights count as
    lora_loads: int = 0  # adapters loaded into a slot (a first use, or again after an eviction)

    @property
    def kv_waste_fraction(self) -> float:
        """Share of the held KV slots that stored nothing, over the run so far (tails of last blocks under paging,
        unused reservations under the reservation policies)."""
        return 1 - self.kv_tokens_stored_sum / self.kv_slots_held_sum if self.kv_slots_held_sum else 0.0

    @property
    def last_step_kv_waste_fraction(self) -> float:
        """The same share in the last step alone (the server's gauge)."""
        return 1 - self.kv_tokens_stored / self.kv_slots_held if self.kv_slots_held else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (cached-but-free blocks count as free)."""
        return self.blocks_in_use / self.num_total_blocks if self.num_total_blocks else 0.0
