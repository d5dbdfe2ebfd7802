"""KV waste accounting, as the vLLM paper measures it: token slots held by running sequences vs tokens stored."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

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
    held = bm.pool.num_used * bs
    return held, held - unused * bs - sum(tails.values())
