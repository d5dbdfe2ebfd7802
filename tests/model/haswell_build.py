"""Builds a few of the C++ kernels for CPUs without AVX-512 (`-march=haswell`: AVX2, FMA, F16C), so that their AVX2
code is compiled and run on whichever CPU kind CI gets; skips where this CPU cannot run it or nothing compiles. On a
CPU without AVX-512 the engine's own build (`-march=native`) is that AVX2 code already: it is used, not built again
(three builds cost ~100 s of the suite on a 2-vCPU AMD EPYC Zen 3)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pagedllm.model import kernels

CSRC = Path(kernels.__file__).parent / "csrc"


def build_for_haswell(name: str, sources: list[Path]) -> ModuleType:
    """The module built from `sources` (and csrc's headers), cached by torch under a name that changes with them."""
    flags = set(kernels._cpu_flags().split())
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU cannot run AVX2 code")
    if "avx512f" not in flags:
        return kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")
    from torch.utils.cpp_extension import load

    key = b"".join(p.read_bytes() for p in [*sources, *CSRC.glob("*.h")]) + str(Path(torch.__file__)).encode()
    try:
        return load(name=f"pagedllm_{name}_haswell_{hashlib.sha256(key).hexdigest()[:12]}",
                    sources=[str(p) for p in sources], extra_cflags=["-O3", "-march=haswell", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)])
    except Exception as exc:  # no compiler: the engine's own build would have failed too
        pytest.skip(f"the haswell build failed: {exc}")
