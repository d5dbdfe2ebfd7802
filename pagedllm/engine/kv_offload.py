"""The prefix cache's second tier for one engine (core/kv_tier.PrefixTier over engine/kv_store.KVFileStore).

Saving: the block manager hands over the registered blocks its sequences let go; they are copied out of the pool in
one gather per cache tensor before anything can overwrite them (before each forward, before a restore, and when the
engine goes idle) and queued for the directory's writer thread, as many as its bounded queue takes (the rest are
dropped and counted): no step waits on the disk. Restoring: at admission, the blocks a prompt's prefix needs after
the pool's own are read (checked) into fresh pool blocks, or taken from the blocks still queued for writing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_tier import TierBlock
from pagedllm.engine.kv_store import KVFileStore, open_store, release_store
from pagedllm.model.bf16_choice import torch_dtype_name
from pagedllm.model.loader import checkpoint_path
from pagedllm.model.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")

FORMAT = 1  # of the payload's layout: [layers, 2 (K, V), block_size, heads, row] in the cache's dtype
RESTORE_CHUNK = 32  # blocks read per copy into the pool: the staging buffer's size, kept (fresh pages cost faults)


def model_identity(config: EngineConfig, runner: ModelRunner) -> bytes:
    """What the K/V of a token prefix depends on: the checkpoint (its path, its files' sizes and times), the model's
    shape, the compute and cache dtypes, the block size and the matmuls run in int4 / int8. A file written under
    another identity is never loaded."""
    path, is_folder = checkpoint_path(config.model, "load")
    files = [os.path.join(path, name) for name in sorted(os.listdir(path))] if is_folder else [path]
    stats = [(os.path.basename(f), st.st_size, st.st_mtime_ns) for f in files if os.path.isfile(f)
             for st in (os.stat(f),)]
    parts = (FORMAT, os.path.realpath(path), stats, dataclasses.asdict(runner.model_config), torch_dtype_name(config),
             str(runner.kv_dtype), runner.block_size, runner.kv_block_shape, sorted(runner.model.int8),
             runner.model.num_int4_matmuls)
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class KVTier:
    """Blocks to save (let go, still in the pool), blocks being saved (copied out, queued), and the restores."""

    def __init__(self, store: KVFileStore, identity: bytes, runner: ModelRunner) -> None:
        self.store = store
        self.identity = identity
        self.runner = runner
        self.block_shape = runner.kv_block_shape
        self.dtype = runner.kv_dtype
        self.block_bytes = math.prod(self.block_shape) * torch.tensor([], dtype=self.dtype).element_size()
        self.to_save: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # digest -> (pool block, tokens), head first
        self.in_flight: dict[bytes, tuple[torch.Tensor, int]] = {}  # digest -> (copied-out batch, index) until written
        self.restores = 0  # restore calls, and their blocks
        self.restored_blocks = 0
        self.restore_seconds = 0.0
        self.dropped = 0  # blocks let go that the write queue had no room for
        self.staging: torch.Tensor | None = None  # [RESTORE_CHUNK, *block_shape], made by the first restore

    @classmethod
    def open(cls, config: EngineConfig, runner: ModelRunner) -> KVTier | None:
        """The engine's tier on config.kv_offload_dir, or None if the directory cannot be opened (logged)."""
        assert config.kv_offload_dir is not None
        store = open_store(config.kv_offload_dir, config.kv_offload_size)
        if not store.enabled:
            release_store(store)
            return None
        return cls(store, model_identity(config, runner), runner)

    # ---- core/kv_tier.PrefixTier ----------------------------------------------------------------------------
    def contains(self, digest: bytes) -> bool:
        return digest in self.to_save or digest in self.in_flight or self.store.contains((self.identity, digest))

    def offload(self, blocks: list[tuple[int, bytes, tuple[int, ...]]]) -> None:
        if not self.store.writable:
            return
        for block_id, digest, tokens in blocks:
            if not self.contains(digest):
                self.to_save[digest] = (block_id, tokens)

    def restore(self, blocks: list[tuple[int, TierBlock]]) -> int:
        self.copy_out()  # the pool blocks about to be filled may hold K/V still to save
        start = time.perf_counter()
        if self.staging is None:
            self.staging = torch.empty((RESTORE_CHUNK, *self.block_shape), dtype=self.dtype)
        raw = self.staging.view(torch.uint8).numpy().reshape(RESTORE_CHUNK, -1)
        done = 0
        for first in range(0, len(blocks), RESTORE_CHUNK):
            chunk = blocks[first:first + RESTORE_CHUNK]
            n = 0
            while n < len(chunk) and self._read(chunk[n][1], self.staging[n], raw[n]):
                n += 1
            if n:
                self.runner.copy_blocks_in([block_id for block_id, _ in chunk[:n]], self.staging[:n])
            done += n
            if n < len(chunk):
                break
        self.restores += 1
        self.restored_blocks += done
        self.restore_seconds += time.perf_counter() - start
        return done

    def _read(self, block: TierBlock, into: torch.Tensor, raw: np.ndarray) -> bool:
        queued = self.in_flight.get(block.digest)
        if queued is not None:  # copied out, not on disk yet
            batch, i = queued
            into.copy_(batch[:, :, i])
            return True
        key = (self.identity, block.digest)
        return self.store.contains(key) and self.store.read(key, block.tokens, raw)  # dropped from the queue: not there

    # ---- saving ------------------------------------------------------------------------------------------
    def copy_out(self) -> None:
        """Copy the blocks let go since the last call out of the pool and queue them for writing, head of each prefix
        first, as many as the queue takes (the rest are dropped: a later prefix hit recomputes them)."""
        if not self.to_save:
            return
        items = list(self.to_save.items())
        self.to_save.clear()
        room = self.store.room(self.block_bytes)
        if room < len(items):
            self.dropped += len(items) - room
            self.store.count_dropped(len(items) - room)
            items = items[:room]
        if not items:
            return
        batch = self.runner.copy_blocks_out([block_id for _, (block_id, _) in items])
        raw = batch.view(torch.uint8).numpy()  # the same memory as bytes, for the writer thread
        for i, (digest, (_, tokens)) in enumerate(items):
            self.in_flight[digest] = (batch, i)
            if not self.store.put((self.identity, digest), tokens, self.block_bytes,
                                  lambda i=i: np.ascontiguousarray(raw[:, :, i]).reshape(-1),
                                  lambda digest=digest: self.in_flight.pop(digest, None)):
                self.in_flight.pop(digest, None)

    # ---- the engine's side ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters for engine.stats()['kv_tier'] (bytes and files are the directory's, for this process)."""
        c = self.store.counters
        return {"restores": self.restores, "restored_blocks": self.restored_blocks,
                "restore_seconds": self.restore_seconds, "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
                "files_written": c.files_written, "writes_dropped": c.writes_dropped, "read_errors": c.read_errors,
                "evictions": c.evictions, "stored_bytes": self.store.total_bytes, "writable": int(self.store.writable)}

    def flush(self, timeout: float | None = None) -> bool:
        """Copy out what is let go and wait until every queued block is on disk."""
        self.copy_out()
        return self.store.flush(timeout)

    def close(self) -> None:
        """Save what is let go and let go of the directory (the last engine of the process closes its store)."""
        self.copy_out()
        release_store(self.store)
