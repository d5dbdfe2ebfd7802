"""Builds the C++ kernels the AVX2 tests check for CPUs without AVX-512 (`-march=haswell`: AVX2, FMA, F16C), so that
their AVX2 code is compiled and run on whichever CPU kind CI gets. Skips where this CPU cannot run it or no compiler
works (the engine's own build failed too); where the engine's kernels build, a failing AVX2 build fails the tests.
One module (haswell_binding.cpp over the kernels' sources), built once by whichever test file asks first: four
builds, each compiling its own binding, took 76-89 s of the suite's setups on the Intel Xeon model 207. On a CPU
without AVX-512 the engine's own build (`-march=native`) is that AVX2 code already: it is used, not built again."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pagedllm.model import kernels

CSRC = Path(kernels.__file__).parent / "csrc"
SOURCES = [Path(__file__).parent / "haswell_binding.cpp", CSRC / "paged_attention.cpp", CSRC / "int4_linear_f32.cpp",
           CSRC / "int4_linear_q8.cpp", CSRC / "int8_gemm.cpp", CSRC / "int8_linear.cpp", CSRC / "top_k.cpp"]


def build_for_haswell() -> ModuleType:
    """The module built from SOURCES (and csrc's headers), cached by torch under a name that changes with them (torch
    locks the build folder: a second process asking meanwhile waits, then loads it)."""
    flags = set(kernels._cpu_flags().split())
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU cannot run AVX2 code")
    if "avx512f" not in flags:
        return kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")
    from torch.utils.cpp_extension import load

    key = b"".join(p.read_bytes() for p in [*SOURCES, *CSRC.glob("*.h")]) + str(Path(torch.__file__)).encode()
    try:
        return load(name=f"pagedllm_haswell_{hashlib.sha256(key).hexdigest()[:12]}",
                    sources=[str(p) for p in SOURCES], extra_cflags=["-O3", "-march=haswell", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)])
    except Exception as exc:
        if kernels.load() is not None:  # a compiler that builds the engine's kernels: the AVX2 code is what failed
            raise
        pytest.skip(f"no compiler: the haswell build failed as the engine's did: {exc}")
