"""The second tier's files: one directory of KV blocks, bounded in bytes, least recently used out, that outlives the
process (no torch: blocks are bytes here; engine/kv_offload.py turns them into pool blocks).

A block is one file, `<dir>/<identity>/<digest>.kv`: a header (magic, format version, the engine identity, the
block's digest, its tokens, the payload's length, a CRC-32 of tokens and payload), the tokens, the payload. A read
checks all of it and loads nothing that does not match: a truncated, corrupt or foreign file is a miss and a log line.
Writes go through one background thread and a bounded queue (the caller drops what does not fit), to a temporary
file renamed into place, so a reader never sees half a block. One process writes a directory: the one holding its
`.lock` (fcntl); others only read it. The index is rebuilt from the directory at start, oldest file first; a read
touches the file, so yesterday's use counts too. A directory that cannot be written (read-only, full, no permission)
degrades to read-only with one log line, one that cannot be opened turns the tier off; never a failed request.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

logger = logging.getLogger("pagedllm")

MAGIC = b"PKVB"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16sIQI")  # magic, version, 0, identity, digest, num tokens, payload bytes, crc32
SUFFIX = ".kv"
LOCK_NAME = ".lock"
MAX_PENDING_BYTES = 256 << 20  # blocks copied out of the pool and waiting for the writer, at most

Key = tuple[bytes, bytes]  # (engine identity, block digest)
Buffer = bytes | bytearray | memoryview  # anything with the buffer protocol (numpy arrays too)


@dataclass
class StoreCounters:
    """What the directory's store did in this process."""

    bytes_read: int = 0
    bytes_written: int = 0
    files_written: int = 0
    writes_dropped: int = 0  # blocks not saved: the queue was full, or the directory stopped taking writes
    read_errors: int = 0  # files that were gone, truncated, corrupt or foreign when read
    evictions: int = 0


@dataclass
class _Write:
    key: Key
    tokens: bytes
    nbytes: int
    payload: Callable[[], Buffer]  # called on the writer thread: the block's bytes
    done: Callable[[], None]  # called on the writer thread once the block is written or given up


def token_bytes(tokens: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


class KVFileStore:
    """One directory's blocks: an index of its files (least recently used first), reads on the caller's thread,
    writes on one background thread."""

    def __init__(self, directory: str, max_bytes: int, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self.counters = StoreCounters()
        self.enabled = True  # the directory could be opened: reads work
        self.writable = False  # this process writes it (holds its lock, and no write has failed)
        self.total_bytes = 0
        self.users = 0  # engines of this process using it (open_store / release_store)
        self._index: OrderedDict[Key, list[float]] = OrderedDict()  # key -> [size, last use], oldest first
        self._cond = threading.Condition()  # guards the index, the queue and the counters
        self._queue: deque[_Write] = deque()
        self._pending_bytes = 0
        self._closing = False
        self._lock_file = None
        self._thread: threading.Thread | None = None
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            self.enabled = False
            logger.warning("KV tier off: cannot open %s (%s); prefixes are recomputed as without it", directory, e)
            return
        self.writable = self._take_lock()
        self._scan()
        if self.writable:
            self._thread = threading.Thread(target=self._write_loop, name="pagedllm-kv-tier-writer", daemon=True)
            self._thread.start()
        logger.info("KV tier %s: %d blocks, %.1f MiB of %.1f MiB%s", directory, len(self._index),
                    self.total_bytes / 2**20, max_bytes / 2**20, "" if self.writable else " (read-only)")

    # ---- reads (the engine's thread) ----------------------------------------------------------------------
    def path(self, key: Key) -> str:
        return os.path.join(self.directory, key[0].hex(), key[1].hex() + SUFFIX)

    def contains(self, key: Key) -> bool:
        """Whether the directory holds the block, from the index; a reader also looks for a file the writing process
        added since (one stat)."""
        with self._cond:
            if key in self._index:
                return True
        if self.writable or not self.enabled:
            return False
        try:
            size = os.stat(self.path(key)).st_size
        except OSError:
            return False
        self._add(key, size, time.time())
        return True

    def read(self, key: Key, tokens: tuple[int, ...], into: Buffer) -> bool:
        """Fill `into` (exactly the payload's length) with the block's bytes, checked; False, logged, if there is no
        such valid file (the block is then recomputed)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                error = self._read_checked(f, key, token_bytes(tokens), memoryview(into).cast("B"))
        except FileNotFoundError:
            error = "the file is gone"
        except OSError as e:
            error = str(e)
        with self._cond:
            if error is None:
                self.counters.bytes_read += HEADER.size + 4 * len(tokens) + memoryview(into).nbytes
                if key in self._index:
                    self._index.move_to_end(key)
                    self._index[key][1] = time.time()
            else:
                self.counters.read_errors += 1
                self._forget(key)
        if error is None:
            with _quietly():
                os.utime(path)  # its last use, for this process's index after a restart and for the writer's
            return True
        logger.warning("KV tier: ignored %s (%s); the block is recomputed", path, error)
        if self.writable and error != "the file is gone":
            with _quietly():
                os.unlink(path)
        return False

    @staticmethod
    def _read_checked(f: BinaryIO, key: Key, tokens: bytes, into: memoryview) -> str | None:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            return "truncated header"
        magic, version, _, identity, digest, num_tokens, payload_len, crc = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION:
            return "not a pagedllm KV block file of this version"
        if identity != key[0]:
            return "written by another model or configuration"
        if digest != key[1] or num_tokens * 4 != len(tokens) or f.read(len(tokens)) != tokens:
            return "another block's file"
        if payload_len != into.nbytes:
            return "another block shape"
        if f.readinto(into) != payload_len or f.read(1):
            return "truncated or overlong"
        if zlib.crc32(into, zlib.crc32(tokens)) != crc:
            return "checksum mismatch"
        return None

    # ---- writes (queued by the engine's thread, done by the writer) -------------------------------------------
    def room(self, nbytes: int) -> int:
        """How many blocks of `nbytes` the write queue takes now (0 if this process does not write)."""
        if not self.writable or HEADER.size + nbytes > self.max_bytes:
            return 0
        with self._cond:
            return max(0, self.max_pending_bytes - self._pending_bytes) // nbytes

    def put(self, key: Key, tokens: tuple[int, ...], nbytes: int, payload: Callable[[], Buffer],
            done: Callable[[], None]) -> bool:
        """Queue a block for writing; False (nothing queued, `done` not called) if the queue is full or closed."""
        with self._cond:
            if not self.writable or self._closing or self._pending_bytes + nbytes > self.max_pending_bytes:
                self.counters.writes_dropped += 1
                return False
            self._queue.append(_Write(key, token_bytes(tokens), nbytes, payload, done))
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return True

    def count_dropped(self, n: int) -> None:
        with self._cond:
            self.counters.writes_dropped += n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or given up); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending_bytes, timeout)

    def _write_loop(self) -> None:
        with _quietly():  # this thread only, on Linux: the steps' threads come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                item = self._queue.popleft()
            try:
                if self.writable:
                    self._write(item)
                else:
                    self.count_dropped(1)
            except Exception:  # never let the writer die: the block is just not saved
                logger.exception("KV tier: writing a block failed")
            finally:
                item.done()
                with self._cond:
                    self._pending_bytes -= item.nbytes
                    self._cond.notify_all()

    def _write(self, item: _Write) -> None:
        path = self.path(item.key)
        payload = item.payload()
        crc = zlib.crc32(payload, zlib.crc32(item.tokens))
        head = HEADER.pack(MAGIC, VERSION, 0, *item.key, len(item.tokens) // 4, memoryview(payload).nbytes, crc)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._write_file(tmp, (head, item.tokens, payload))
            os.replace(tmp, path)  # atomic: a reader sees the old file, the new one, or none
        except OSError as e:
            with _quietly():
                os.unlink(tmp)
            self._stop_writing(e)
            return
        size = len(head) + len(item.tokens) + memoryview(payload).nbytes
        self._add(item.key, size, time.time())
        with self._cond:
            self.counters.bytes_written += size
            self.counters.files_written += 1
        self._evict()

    @staticmethod
    def _write_file(path: str, parts: tuple[Buffer, ...]) -> None:
        with open(path, "wb") as f:
            for part in parts:
                f.write(part)

    def _stop_writing(self, error: OSError) -> None:
        """A full disk, a read-only directory, a permission taken away: keep reading, stop writing (said once)."""
        with self._cond:
            if not self.writable:
                return
            self.writable = False
        logger.warning("KV tier %s: cannot write (%s); read-only from now on (blocks already there are still "
                       "restored)", self.directory, error)

    def _evict(self) -> None:
        """Remove the least recently used files until the directory fits its size; a file another process read since
        this one last used it (its mtime is newer) gets another round instead."""
        while True:
            with self._cond:
                if self.total_bytes <= self.max_bytes or len(self._index) <= 1:
                    return
                key, (size, used) = next(iter(self._index.items()))
            try:
                touched = os.stat(self.path(key)).st_mtime > used + 1.0
            except OSError:
                touched = False
            with self._cond:
                if key not in self._index:
                    continue
                if touched:
                    self._index.move_to_end(key)
                    self._index[key][1] = time.time()
                    continue
                self._forget(key)
                self.counters.evictions += 1
            with _quietly():
                os.unlink(self.path(key))

    # ---- the index -------------------------------------------------------------------------------------------
    def _add(self, key: Key, size: int, used: float) -> None:
        with self._cond:
            self._forget(key)
            self._index[key] = [size, used]
            self.total_bytes += size

    def _forget(self, key: Key) -> None:
        """(Holding the condition.) Drop a key from the index."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self.total_bytes -= int(entry[0])

    def _scan(self) -> None:
        """Rebuild the index from the directory, oldest use first; the writer removes temporary files a killed
        process left behind."""
        found = []
        for sub in _entries(self.directory):
            if not sub.is_dir() or _hex(sub.name) is None:
                continue
            for entry in _entries(sub.path):
                digest = _hex(entry.name.removesuffix(SUFFIX)) if entry.name.endswith(SUFFIX) else None
                if entry.name.endswith(".tmp") and self.writable:
                    with _quietly():
                        os.unlink(entry.path)
                elif digest is not None:
                    with _quietly():
                        st = entry.stat()
                        found.append((st.st_mtime, (_hex(sub.name), digest), st.st_size))
        for used, key, size in sorted(found):
            self._add(key, size, used)
        if self.writable and self.total_bytes > self.max_bytes:
            self._evict()

    def _take_lock(self) -> bool:
        """This process writes the directory if it can hold `.lock`; else it only reads (said once)."""
        try:
            f = open(os.path.join(self.directory, LOCK_NAME), "a+b")
        except OSError as e:
            logger.warning("KV tier %s is read-only (%s): prefixes are restored from it, none saved", self.directory, e)
            return False
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            logger.warning("KV tier %s: another process writes it; this one only reads it", self.directory)
            return False
        self._lock_file = f
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (within `timeout`), stop the writer and let go of the lock."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None
        self.writable = False


class _quietly:
    """`with _quietly():` ignores an OSError (best-effort file operations)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


def _hex(name: str) -> bytes | None:
    """A 16-byte name written as 32 hex digits (an identity or a digest), or None."""
    try:
        return bytes.fromhex(name) if len(name) == 32 else None
    except ValueError:
        return None


def _entries(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


# ---- one store per directory and process ---------------------------------------------------------------------
_stores: dict[str, KVFileStore] = {}
_stores_lock = threading.Lock()


def open_store(directory: str, max_bytes: int) -> KVFileStore:
    """The directory's store, shared by the engines of this process (one writer, one size bound)."""
    path = os.path.realpath(os.path.expanduser(directory))
    with _stores_lock:
        store = _stores.get(path)
        if store is None:
            store = _stores[path] = KVFileStore(path, max_bytes)
        elif store.max_bytes != max_bytes:
            logger.warning("KV tier %s is already open in this process with a size of %d bytes; keeping it",
                           path, store.max_bytes)
        store.users += 1
        return store


def release_store(store: KVFileStore) -> None:
    """One engine is done with the store; the last one closes it (its queued blocks written first)."""
    with _stores_lock:
        store.users -= 1
        if store.users > 0:
            return
        if _stores.get(store.directory) is store:
            del _stores[store.directory]
    store.close()


@atexit.register
def _close_all() -> None:
    """At exit, write what the writers still hold: the next start finds those prefixes too."""
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        store.close(timeout=10.0)
