"""Writes q8probe.cpp: a copy of int4_linear_q8.cpp with a global g_probe whose bits skip the activations'
quantisation (1), the weights' unpacking (2) and the blocks' sums (4). usage: python probe_patch.py CSRC_DIR OUT_DIR"""
import sys

src = open(f"{sys.argv[1]}/int4_linear_q8.cpp").read()
for old, new in [
    ("namespace {\n\nconstexpr int64_t kTile",
     "int g_probe = 0;  // bit 0: skip quantize, bit 1: skip unpack, bit 2: skip run_rows\nnamespace {\n\nconstexpr int64_t kTile"),
    ("  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {\n    thread_local std::vector<float> work;",
     "  if (!(g_probe & 1)) at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {\n    thread_local std::vector<float> work;"),
    ("        unpack_tile(pk +", "        if (!(g_probe & 2)) unpack_tile(pk +"),
    ("        run_rows(w, dm, rows,", "        if (!(g_probe & 4)) run_rows(w, dm, rows,"),
]:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
open(f"{sys.argv[2]}/q8probe.cpp", "w").write(src)
