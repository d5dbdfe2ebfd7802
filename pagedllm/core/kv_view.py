"""A view of the paged KV cache as it lives, for a dashboard or a trace (no torch, no HTTP): per block its state
and ref count, per request its samples' block tables, and the events kv_events.KVRecorder kept.

The work happens only when a viewer asks: `KVView.snapshot` lists every held block the first time, then only the
blocks that changed since an earlier snapshot (read off the recorder), so a 17k-block pool does not mean 17k cells
per frame.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, replace

from pagedllm.core.block_manager import blocks_for
from pagedllm.core.kv_events import KVEvent, KVRecorder
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import SequenceGroup

# A block's state in a snapshot, by what it shows about memory use.
FREE = 0  # no holder, nothing cached
USED = 1  # held by one sequence
SHARED = 2  # held by several (parallel samples, a common prefix): ref count > 1
CACHED = 3  # no holder, but keeps a prefix the cache can hand out again until the pool needs the block
RESERVED = 4  # held but storing no token yet: a contiguous reservation's unused part (core/baselines.py)
RESTORED = 5  # held, its K/V copied back from the second tier (--kv-offload-dir) rather than computed
ADAPTER = 6  # held by a resident LoRA adapter's weights (S-LoRA's unified paging: core/adapters.py)
STATE_NAMES = ("free", "used", "shared", "cached", "reserved", "restored", "adapter")

MAX_EVENTS_PER_SNAPSHOT = 256
MAX_WAITING_LISTED = 64  # a snapshot lists every running request and the first waiting ones


@dataclass
class SeqView:
    """One sample of a request: its block table (logical -> physical), tokens stored in it vs slots it holds."""

    seq_id: Hashable
    index: int
    status: str  # waiting | running | finished
    num_tokens: int  # prompt + output tokens so far
    tokens_stored: int  # tokens with K/V in the cache
    slots_held: int  # len(block_table) * block_size
    output_tokens: int
    preemptions: int
    block_table: list[int]


@dataclass
class RequestView:
    """A request as the scheduler holds it: `preempted` is waiting again after it ran."""

    request_id: str
    status: str  # waiting | running | preempted
    prompt_tokens: int
    n: int
    samples: list[SeqView]
    prompt: str = ""  # its first words, filled in by the engine (the core has no tokenizer)
    priority: int = 0
    client: str = ""  # "" for a request that names none


@dataclass
class KVCounters:
    """The pool and its history in numbers (prefix cache figures are tokens, as /metrics counts them)."""

    num_blocks: int
    blocks_in_use: int
    blocks_cached_free: int
    num_running: int  # requests (sequence groups), as /metrics counts them
    num_waiting: int
    cow_copies: int
    forks: int
    preemptions: int
    evictions: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    generated_tokens: int = 0  # filled in by the engine
    adapter_blocks: int = 0  # held by resident LoRA adapters


@dataclass
class KVSnapshot:
    """The KV cache at one moment. `blocks` is a flat list of (block id, state, ref count) triples: every block not
    FREE when `full`, else every block whose state may have changed since the snapshot the caller asked from."""

    version: int  # pass it as `since` to get the next snapshot as a diff
    full: bool
    step: int
    time: float
    num_blocks: int
    block_size: int
    kv_policy: str
    blocks: list[int]
    requests: list[RequestView]
    counters: KVCounters
    events: list[KVEvent]  # since the snapshot asked from (the latest ones of a full snapshot)
    events_dropped: int = 0  # events that happened but are not in `events`
    # per client, the most served first: requests, tokens, queue time, service (core/service.py; filled by the engine)
    clients: list[dict[str, float | int | str]] = field(default_factory=list)


@dataclass
class _Mark:
    """Where the recorder stood at a snapshot, and which blocks were reserved then (their state changes silently
    as tokens fill them)."""

    num_changes: int
    num_events: int
    reserved: set[int] = field(default_factory=set)


class KVView:
    """Snapshots of one scheduler's KV cache: full, or the blocks changed since one of the last `keep` snapshots.
    Several readers may take turns; each passes the version of its own last snapshot."""

    def __init__(self, scheduler: Scheduler, keep: int = 16) -> None:
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.pool = self.block_manager.pool
        self.recorder: KVRecorder = self.block_manager.recorder
        self.kv_policy: str = getattr(scheduler, "kv_policy", "paged")
        self.keep = keep
        self.version = 0
        self.marks: OrderedDict[int, _Mark] = OrderedDict()
        self.names: dict[Hashable, str] = {}  # seq id -> request id (#sample), for the events that name a sequence

    def snapshot(self, since: int | None = None) -> KVSnapshot:
        """Every held block if `since` is None or too old, else those that changed since snapshot `since`;
        O(changes + block tables), plus O(pool) for a full one."""
        mark = self.marks.get(since) if since is not None else None
        changed = self.recorder.changes_since(mark.num_changes) if mark else None
        groups = self._listed_groups()
        reserved = self._reserved_blocks(groups)
        adapters = {b for blocks in self.block_manager.adapter_blocks.values() for b in blocks}
        if mark is None or changed is None:
            full, blocks = True, [b for b, rc in enumerate(self.pool.ref_counts) if rc or b in self.pool.contents]
            events, dropped = self.recorder.events_since(0, MAX_EVENTS_PER_SNAPSHOT)
        else:
            full, blocks = False, sorted(changed | (reserved ^ mark.reserved))  # a block filled without a pool change
            events, dropped = self.recorder.events_since(mark.num_events, MAX_EVENTS_PER_SNAPSHOT)
        triples: list[int] = []
        for b in blocks:
            triples += (b, ADAPTER if b in adapters else self._state(b, reserved), self.pool.ref_counts[b])
        requests = [self._request_view(g, running) for g, running in groups]
        if len(self.names) > 8192:  # forget the sequences that are gone
            live = {seq.seq_id for g, _ in groups for seq in g.seqs}
            self.names = {k: v for k, v in self.names.items() if k in live}
        self.version += 1
        self.marks[self.version] = _Mark(self.recorder.num_changes, self.recorder.num_events, reserved)
        while len(self.marks) > self.keep:
            self.marks.popitem(last=False)
        return KVSnapshot(self.version, full, self.recorder.step, time.time(), self.pool.num_blocks,
                          self.block_manager.block_size, self.kv_policy, triples, requests, self._counters(),
                          [self._named(e) for e in events], dropped)

    def _listed_groups(self) -> list[tuple[SequenceGroup, bool]]:
        s = self.scheduler
        waiting = itertools.islice(s.waiting, MAX_WAITING_LISTED)
        return [(g, True) for g in s.running] + [(g, False) for g in waiting]

    def _reserved_blocks(self, groups: Iterable[tuple[SequenceGroup, bool]]) -> set[int]:
        """Held blocks past the tokens their sequence stores (only reservations have them; a paged table grows
        one block at a time)."""
        bm, bs, reserved = self.block_manager, self.block_manager.block_size, set()
        for group, running in groups:
            for seq in group.seqs if running else ():
                if bm.has_table(seq.seq_id):
                    reserved.update(bm.block_table(seq.seq_id)[blocks_for(seq.num_computed_tokens, bs):])
        return reserved

    def _state(self, block_id: int, reserved: set[int]) -> int:
        rc = self.pool.ref_counts[block_id]
        if rc == 0:
            return CACHED if block_id in self.pool.contents else FREE
        if block_id in reserved:
            return RESERVED
        content = self.pool.contents.get(block_id)
        if content is not None and content.restored:
            return RESTORED
        return SHARED if rc > 1 else USED

    def _request_view(self, group: SequenceGroup, running: bool) -> RequestView:
        bm, bs = self.block_manager, self.block_manager.block_size
        samples = []
        for seq in group.seqs:
            table = list(bm.block_table(seq.seq_id)) if bm.has_table(seq.seq_id) else []
            samples.append(SeqView(seq.seq_id, seq.index, seq.status.value, seq.num_tokens, seq.num_computed_tokens,
                                   len(table) * bs, seq.num_output_tokens, seq.num_preemptions, table))
            self.names[seq.seq_id] = group.request_id if len(group.seqs) == 1 else f"{group.request_id}#{seq.index}"
        first = group.seqs[0]
        status = "running" if running else "preempted" if any(s.num_preemptions for s in group.seqs) else "waiting"
        return RequestView(group.request_id, status, first.num_prompt_tokens, len(group.seqs), samples,
                           priority=group.priority, client=group.client or "")

    def _named(self, event: KVEvent) -> KVEvent:
        if event.request_id is None and event.seq_id in self.names:
            return replace(event, request_id=self.names[event.seq_id])
        return event

    def _counters(self) -> KVCounters:
        bm, pool, s, counts = self.block_manager, self.pool, self.scheduler, self.recorder.counts
        return KVCounters(pool.num_blocks, pool.num_used, pool.num_cached_free, len(s.running), len(s.waiting),
                          bm.num_cow_copies, counts["fork"], s.num_preemptions, pool.num_evictions,
                          bm.prefix_cache_hits, bm.prefix_cache_queries, adapter_blocks=bm.num_adapter_blocks)

