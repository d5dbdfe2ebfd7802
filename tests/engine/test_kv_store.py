"""The second tier's directory (engine/kv_store.py) on its own, no model: a block written is read back only if it is
whole and its own (a truncated, corrupt or foreign file is a miss, never loaded), the size bound holds least recently
used out, the index survives a restart, one process writes and a directory that cannot be written degrades."""

from __future__ import annotations

import logging
import os

import pytest

from pagedllm.engine.kv_store import HEADER, KVFileStore, open_store, release_store

IDENTITY = bytes(range(16))
PAYLOAD = 1000
TOKENS = (5, 6, 7, 8)


def key(i: int, identity: bytes = IDENTITY) -> tuple[bytes, bytes]:
    return identity, i.to_bytes(16, "little")


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(PAYLOAD))


def put(store: KVFileStore, i: int, identity: bytes = IDENTITY) -> None:
    assert store.put(key(i, identity), TOKENS, PAYLOAD, lambda: payload(i), lambda: None)


def read(store: KVFileStore, i: int, tokens: tuple[int, ...] = TOKENS) -> bytes | None:
    into = bytearray(PAYLOAD)
    return bytes(into) if store.read(key(i), tokens, into) else None


@pytest.fixture
def store(tmp_path):
    s = KVFileStore(str(tmp_path / "tier"), max_bytes=1 << 20)
    yield s
    s.close()


FILE_BYTES = HEADER.size + 4 * len(TOKENS) + PAYLOAD


def test_a_block_comes_back_as_written_and_only_for_its_tokens(store):
    put(store, 1)
    assert store.flush(10)
    assert store.contains(key(1)) and not store.contains(key(2))
    assert read(store, 1) == payload(1)
    assert read(store, 1, tokens=(5, 6, 7, 9)) is None  # the same digest with other tokens: not this block
    assert store.counters.files_written == 1 and store.counters.bytes_written == FILE_BYTES
    assert not [n for n in os.listdir(os.path.dirname(store.path(key(1)))) if n.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "garbage"])
def test_a_damaged_or_foreign_file_is_a_miss_and_a_log_line(store, damage, caplog):
    put(store, 1)
    assert store.flush(10)
    path = store.path(key(1))
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip":
        data[-5] ^= 0xFF
    elif damage == "foreign":  # another engine's identity in the header, under our name: never loaded
        data[8:24] = bytes(16)
    else:
        data = bytearray(b"not a block at all")
    open(path, "wb").write(data)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert read(store, 1) is None
    assert "KV tier: ignored" in caplog.text
    assert store.counters.read_errors == 1
    assert not store.contains(key(1)) and not os.path.exists(path)  # the writer removes it


def test_a_file_gone_is_a_miss(store):
    put(store, 1)
    assert store.flush(10)
    os.unlink(store.path(key(1)))
    assert read(store, 1) is None and store.counters.read_errors == 1


def test_the_size_bound_holds_least_recently_used_out(tmp_path):
    store = KVFileStore(str(tmp_path / "tier"), max_bytes=5 * FILE_BYTES)
    try:
        for i in range(5):
            put(store, i)
        assert store.flush(10)
        assert read(store, 0) == payload(0)  # block 0 used again: block 1 is now the oldest
        for i in range(5, 8):
            put(store, i)
        assert store.flush(10)
        on_disk = [os.path.join(dp, f) for dp, _, fs in os.walk(store.directory) for f in fs if f.endswith(".kv")]
        assert sum(os.path.getsize(p) for p in on_disk) <= 5 * FILE_BYTES == store.total_bytes
        assert [i for i in range(8) if store.contains(key(i))] == [0, 4, 5, 6, 7]
        assert store.counters.evictions == 3
    finally:
        store.close()


def test_the_index_survives_a_restart_oldest_use_first(tmp_path):
    directory = str(tmp_path / "tier")
    first = KVFileStore(directory, max_bytes=1 << 20)
    for i in range(3):
        put(first, i)
    first.close()
    for i, age in enumerate((30, 10, 20)):  # last used: 1, then 2, then 0
        os.utime(first.path(key(i)), (os.path.getmtime(first.path(key(i))) - age,) * 2)
    second = KVFileStore(directory, max_bytes=2 * FILE_BYTES)  # smaller now: the oldest goes at start
    try:
        assert second.writable and second.total_bytes == 2 * FILE_BYTES
        assert [i for i in range(3) if second.contains(key(i))] == [1, 2]
        assert read(second, 2) == payload(2)
    finally:
        second.close()


def test_one_process_writes_another_only_reads(tmp_path):
    directory = str(tmp_path / "tier")
    writer = KVFileStore(directory, max_bytes=1 << 20)
    reader = KVFileStore(directory, max_bytes=1 << 20)  # its own open file: the lock is taken
    try:
        assert writer.writable and not reader.writable
        assert reader.room(PAYLOAD) == 0
        put(writer, 1)
        assert writer.flush(10)
        assert reader.contains(key(1)) and read(reader, 1) == payload(1)  # written since the reader started
    finally:
        writer.close()
        reader.close()


def test_an_engine_per_process_shares_one_store(tmp_path):
    directory = str(tmp_path / "tier")
    a, b = open_store(directory, 1 << 20), open_store(directory + "/", 1 << 20)
    assert a is b and a.writable and a.users == 2
    release_store(a)
    assert b.writable
    release_store(b)
    assert not b.writable  # closed: the next one opens the directory anew
    c = open_store(directory, 1 << 20)
    assert c is not a and c.writable
    release_store(c)


def test_a_directory_that_cannot_be_written_degrades_to_read_only(store, monkeypatch, caplog):
    put(store, 1)
    assert store.flush(10)

    def refuse(path, parts):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(KVFileStore, "_write_file", staticmethod(refuse))
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        for i in (2, 3):
            store.put(key(i), TOKENS, PAYLOAD, lambda: payload(0), lambda: None)
        assert store.flush(10)
    assert not store.writable and store.room(PAYLOAD) == 0
    assert caplog.text.count("read-only from now on") == 1
    assert read(store, 1) == payload(1)  # what is there is still restored
    assert not store.contains(key(2))


def test_a_directory_that_cannot_be_made_turns_the_tier_off(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        store = KVFileStore(str(blocker / "tier"), max_bytes=1 << 20)
    assert not store.enabled and not store.writable and not store.contains(key(1))
    assert "KV tier off" in caplog.text
    store.close()


def test_temporary_files_of_a_killed_writer_are_removed(tmp_path):
    directory = tmp_path / "tier" / IDENTITY.hex()
    directory.mkdir(parents=True)
    (directory / (key(1)[1].hex() + ".kv.123.tmp")).write_bytes(b"half")
    store = KVFileStore(str(tmp_path / "tier"), max_bytes=1 << 20)
    store.close()
    assert os.listdir(directory) == []
