"""Stored responses of /v1/responses (`store: true`), for `previous_response_id`, GET, DELETE and cancel: kept in
memory, least recently used first out, bounded in entries and bytes, each forgotten `ttl` seconds after its last
use. A flood of stored responses never grows the server past the bounds."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol_responses import ResponseObject

STORE_MAX_BYTES = 256 << 20  # what all stored responses (and their conversations) may hold


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict[str, Any]]  # the conversation through this response's output, as chat messages
    task: asyncio.Task | None = None  # a background response still being generated
    size: int = 0  # bytes, roughly: what the bound counts
    expires: float = field(default=0.0, repr=False)


def entry_size(entry: StoredResponse) -> int:
    """Characters of the stored texts: the output's and the conversation's (the bulk of an entry)."""
    texts = sum(len(str(m.get("content") or "")) + sum(len(str(c)) for c in m.get("tool_calls") or [])
                for m in entry.messages)
    return 512 + texts + sum(len(getattr(i, "arguments", "")) for i in entry.response.output)


class ResponseStore:
    """An LRU map of response id to StoredResponse, with a size and byte limit and a time to live."""

    def __init__(self, max_entries: int, ttl: float, max_bytes: int = STORE_MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl, self.max_bytes = max_entries, ttl, max_bytes
        self.clock = clock
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) an entry, then evict the least recently used until the bounds hold; an entry larger
        than all the store may hold is not kept."""
        self.delete(entry.response.id)
        entry.size = entry_size(entry)
        if entry.size > self.max_bytes:
            return
        entry.expires = self.clock() + self.ttl
        self._entries[entry.response.id] = entry
        self.bytes += entry.size
        self._expire()
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._pop_oldest()

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, made most recently used (its TTL starts over), or None if unknown or expired."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            entry.expires = self.clock() + self.ttl
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def _expire(self) -> None:
        """Drop expired entries: the least recently used expire first, so they are at the front."""
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size
