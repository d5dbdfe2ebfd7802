"""Run another docs script as a CPU without AVX-512 would: pagedllm's C++ kernels built for haswell (AVX2, FMA, F16C:
their AVX2 or generic paths), oneDNN and ATen capped at AVX2, and a kernel table of its own (keyed as a CPU without the
avx512 flags, in its own cache folder unless PAGEDLLM_CACHE_DIR names one), `--dtype auto` choosing fp32 as there. An
approximation of an AVX2-only machine (the caches and memory are this one's):

    python docs/scripts/as_avx2.py docs/scripts/kv_cache_dtype_ab.py fp32-cache
    python docs/scripts/as_avx2.py docs/scripts/kv_cache_dtype_ab.py default
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile

os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # read by oneDNN and ATen when torch loads: before any import of torch
os.environ["ATEN_CPU_CAPABILITY"] = "avx2"

import pagedllm.model.bf16_choice as bf16_choice  # noqa: E402
import pagedllm.model.kernels as kernels  # noqa: E402
import pagedllm.model.machine_cache as machine_cache  # noqa: E402

bf16_choice.bf16_pays = lambda: False  # `--dtype auto` as such a CPU: fp32 arithmetic (over a bf16 KV cache)

kernels._CFLAGS = ["-O3", "-march=haswell", "-fopenmp"]  # part of the build's name: a build of its own
os.environ.setdefault(machine_cache.CACHE_ENV, os.path.join(tempfile.gettempdir(), "pagedllm-as-avx2"))
_identity = machine_cache.cpu_identity


def identity_without_avx512() -> tuple[str, str]:
    name, flags = _identity()
    return f"{name} (as AVX2)", " ".join(f for f in flags.split() if "avx512" not in f and "amx" not in f)


machine_cache.cpu_identity = identity_without_avx512

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
