"""The KV pool is mapped in the background (model/prefault.py): every page ends up resident, nothing stored
changes."""

from __future__ import annotations

import ctypes
import mmap
import sys
import time

import pytest
import torch

from pagedllm import LLM
from pagedllm.model.prefault import PAGE, KVPrefault

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux")


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the tensor's pages that are in memory (mincore)."""
    start = t.data_ptr() - t.data_ptr() % PAGE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


def test_the_pool_is_resident_after_the_wait(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory="48MiB")
    assert llm.engine.wait_for_kv_cache(timeout=60)
    if llm.engine.runner.prefault.error:  # a kernel older than 5.14: nothing mapped ahead, nothing broken
        pytest.skip(f"no MADV_POPULATE_WRITE here: {llm.engine.runner.prefault.error}")
    for k_cache, v_cache in llm.engine.runner.kv_caches:
        assert resident_fraction(k_cache) == 1.0 and resident_fraction(v_cache) == 1.0


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_the_pool_asks_for_huge_pages_where_the_kernel_has_them(tiny_model_dir):
    """MADV_HUGEPAGE on each cache tensor before it is touched (the smaps flag `hg`), where THP is not off."""
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory="48MiB")
    assert llm.engine.runner.prefault.huge_pages == ("[never]" not in thp)
    if llm.engine.runner.prefault.huge_pages:
        k_cache = llm.engine.runner.kv_caches[0][0]
        assert "hg" in vm_flags(k_cache.data_ptr() + k_cache.numel() * k_cache.element_size() // 2)


def test_mapping_never_changes_what_is_stored():
    """Values written before and while the thread runs are all still there after it (it maps, it never writes)."""
    caches = [torch.empty(2048, 16, 2, 64) for _ in range(6)]
    caches[0].fill_(float("nan"))
    prefault = KVPrefault(caches)
    for i, t in enumerate(caches[1:], start=1):
        t.fill_(float(i))
    assert prefault.wait(timeout=60)
    assert torch.isnan(caches[0]).all()
    assert all((t == i).all() for i, t in enumerate(caches[1:], start=1))



def test_only_blocks_ahead_of_use_are_mapped_until_the_wait():
    """A step's highest block moves the mapped span; the rest of the pool stays unmapped until `wait()` asks for it."""
    buffers = [mmap.mmap(-1, 8192 * 16 * 2 * 64 * 4) for _ in range(2)]  # fresh anonymous pages, none resident
    caches = [torch.frombuffer(b, dtype=torch.float32).view(8192, 16, 2, 64) for b in buffers]
    prefault = KVPrefault(caches, ahead=256)
    prefault.run_ahead_of(1023)
    deadline = time.monotonic() + 60
    while resident_fraction(caches[1][:1280]) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if prefault.error:
        pytest.skip(f"no MADV_POPULATE_WRITE here: {prefault.error}")
    assert resident_fraction(caches[0][:1280]) == resident_fraction(caches[1][:1280]) == 1.0
    assert resident_fraction(caches[0][1536:]) == 0.0 and not prefault.done.is_set()
    assert prefault.wait(timeout=60)
    assert resident_fraction(caches[0]) == resident_fraction(caches[1]) == 1.0


def test_the_waiting_thread_and_the_background_one_map_each_block_once():
    """`wait()` maps chunks from the top while the thread maps from the bottom: together every block, none twice."""
    caches = [torch.empty(1000, 4, 256) for _ in range(3)]
    prefault = KVPrefault(caches, ahead=0)  # the thread waits for a step until wait() wants the pool
    assert prefault.wait(timeout=60)
    if prefault.error:
        pytest.skip(f"no MADV_POPULATE_WRITE here: {prefault.error}")
    assert prefault._num_mapped == 1000
    assert prefault._high < 1000  # the waiting thread claimed (and mapped) chunks from the top
    assert all(resident_fraction(t) == 1.0 for t in caches)


def test_a_serving_engine_starts_with_its_whole_pool_mapped(tiny_model_dir):
    """`pagedllm serve` and the replicas build their engine this way: no request pays a first touch of the pool."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_engine import build_serving_engine

    engine = build_serving_engine(EngineConfig(model=tiny_model_dir, dtype="float32", kv_cache_memory="48MiB"))
    assert engine.runner.prefault.done.is_set()
    if engine.runner.prefault.error:
        pytest.skip(f"no MADV_POPULATE_WRITE here: {engine.runner.prefault.error}")
    assert all(resident_fraction(t) == 1.0 for pair in engine.runner.kv_caches for t in pair)
