"""What happens to KV blocks, as it happens: the block pool, block manager and scheduler record here every block
whose ref count or cached state changes, and events (copy-on-write copies, forks, preemptions, prefix-cache hits,
evictions). Each record is one deque append, so recording stays on; `kv_view.KVView` reads it when asked."""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass

EVENT_KINDS = ("cow", "fork", "preempt", "prefix_hit", "evict", "reset", "restore", "adapter_load", "adapter_evict")


@dataclass(slots=True)
class KVEvent:
    """One thing that happened to blocks. `blocks`: cow (source, copy); fork, prefix_hit and preempt the blocks
    shared or freed; evict the block whose cached prefix went; restore the blocks filled from the second tier;
    adapter_load / adapter_evict the blocks a LoRA adapter's weights took or gave back (`seq_id`: the adapter's id).
    `tokens`: a prefix hit's tokens found in the cache, or a restore's tokens."""

    index: int  # events are numbered from 0 in the order they happened
    step: int  # the scheduler step in which it happened
    kind: str  # one of EVENT_KINDS
    seq_id: Hashable | None = None
    request_id: str | None = None  # named by the scheduler, or by a snapshot that knows the sequence
    blocks: tuple[int, ...] = ()
    tokens: int = 0


class KVRecorder:
    """The recent history of the KV blocks, bounded: the last `max_events` events and the last `max_changes` block
    ids whose state changed. The totals count everything ever recorded, so a reader knows when it missed some."""

    def __init__(self, max_events: int = 4096, max_changes: int = 1 << 16) -> None:
        self.events: deque[KVEvent] = deque(maxlen=max_events)
        self.changes: deque[int] = deque(maxlen=max_changes)
        self.num_events = 0
        self.num_changes = 0
        self.counts: Counter[str] = Counter()  # events by kind, since the start
        self.step = 0  # bumped by Scheduler.schedule

    def changed(self, block_id: int) -> None:
        self.changes.append(block_id)
        self.num_changes += 1

    def record(self, kind: str, seq_id: Hashable | None = None, request_id: str | None = None,
               blocks: tuple[int, ...] = (), tokens: int = 0) -> None:
        self.events.append(KVEvent(self.num_events, self.step, kind, seq_id, request_id, blocks, tokens))
        self.num_events += 1
        self.counts[kind] += 1

    def changes_since(self, num_changes: int) -> set[int] | None:
        """Blocks changed after the first `num_changes` changes; None if some of them were already dropped."""
        missed = self.num_changes - num_changes
        if missed > len(self.changes):
            return None
        return set(itertools.islice(reversed(self.changes), missed))

    def events_since(self, num_events: int, limit: int) -> tuple[list[KVEvent], int]:
        """The events after the first `num_events` (the latest `limit` of them), and how many were left out."""
        missed = self.num_events - num_events
        kept = min(missed, len(self.events), limit)
        return list(itertools.islice(reversed(self.events), kept))[::-1], missed - kept


