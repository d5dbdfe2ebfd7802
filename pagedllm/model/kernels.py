"""pagedllm's C++ kernels (csrc/): compiled into one extension on first use, cached on disk by torch, so later
processes just load it. Without a compiler everything still runs, on the slower torch paths."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))  # not compiled on their own, but part of the build's identity
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_ext: ModuleType | None = None
_ext_error: str | None = None


def load() -> ModuleType | None:
    """The compiled extension, or None if it failed to build (`build_error()` says why)."""
    global _ext, _ext_error
    if _ext is not None or _ext_error is not None:
        return _ext
    with _lock:
        if _ext is None and _ext_error is None:
            try:
                import torch
                from torch.utils.cpp_extension import load as load_extension

                # -march=native: a build is only valid for this CPU, so its features are part of the name. So are
                # the source folder and the torch install: two checkouts or venvs sharing torch's cache folder
                # under one name rebuilt it from scratch (~30 s) each time the other had built it last.
                key = source_digest().encode() + _cpu_flags().encode()
                key += str(_CSRC.resolve()).encode() + str(Path(torch.__file__).resolve().parent).encode()
                digest = hashlib.sha256(key).hexdigest()[:16]
                path = os.environ.get("PATH", "")
                os.environ["PATH"] = ninja_first(path)
                try:
                    _ext = load_extension(name=f"pagedllm_kernels_{digest}", sources=[str(p) for p in _SOURCES],
                                          extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, verbose=False)
                finally:
                    os.environ["PATH"] = path
            except Exception as exc:  # no compiler, no ninja, bad flags: the torch paths still work
                _ext_error = f"{type(exc).__name__}: {exc}"
    return _ext


@functools.cache
def source_digest() -> str:
    """The kernels' sources and compiler flags, hashed: part of the build's name, and of the kernel tables' keys (a
    table timed on another version of the kernels, before an upgrade, is not this one's)."""
    data = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + repr(_CFLAGS).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def ninja_first(path: str) -> str:
    """PATH with the ninja installed beside pagedllm (a dependency) first, as torch finds ninja on PATH: a build's log
    is in its ninja version's format, so a process that found another one (the system's, where the venv is not
    activated) rebuilt every kernel (~2 min on 2 cores), and one that found none built nothing."""
    try:
        import ninja
    except ImportError:
        return path
    return os.pathsep.join(d for d in (ninja.BIN_DIR, path) if d)


def build_error() -> str | None:
    return _ext_error


@functools.cache
def cpu_has_amx() -> bool:
    """AMX tiles: oneDNN's bf16 matmuls run on them, several times faster than any AVX-512 kernel here."""
    return "amx_bf16" in _cpu_flags()


def int8_products_exact() -> bool:
    """Whether oneDNN's int8 matmul (torch._int_mm) and int8_gemm are exact here: with VNNI (or AMX) a u8 x s8 pair
    sums into int32. Without it oneDNN pairs them into int16 with saturation (vpmaddubsw): on AVX2 alone, or with
    ONEDNN_MAX_CPU_ISA capped below VNNI, random int8 products came out up to 20% off (docs/performance-log.md)."""
    flags = _cpu_flags().split()
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ("SSE41", "AVX", "AVX2", "AVX512_CORE")
    return not capped and any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def int8_available() -> bool:
    """Whether int8 products run exactly here by some path: int8_gemm (VNNI, or AVX2's vpmaddubsw) or
    oneDNN's int8 matmul (VNNI, AMX). Where neither, the engine runs no int8 at all."""
    ext = load()
    return int8_products_exact() or (ext is not None and ext.int8_gemm_supported())


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
