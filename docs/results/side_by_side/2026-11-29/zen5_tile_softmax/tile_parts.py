"""Where the bf16 tiled (prompt) attention kernel spends its time: the kernel built alone (with the tests' binding of
then, tests/model/attention_binding.cpp, until c23c35b),
as it is and with one part taken out (its line made an empty statement; results wrong, only timed), on one prompt
of N tokens with the default model's heads (9/3 x 64, bf16 queries and cache, blocks of 16 in random order); ms per
layer call, min and median of 28 calls, the variants alternated twice. From the repository root:
python .../tile_parts.py [N]"""
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

CSRC, BINDING = Path("pagedllm/model/csrc"), Path("tests/model/attention_binding.cpp")
TILE = "attend_tile.h"
CUTS = {  # variant: (file, the line taken out)
    "as is": None,
    "no scores (QK)": (TILE, "      tile_scores_bf16(P, base, cn, cn_padded, g, rv0, RV, Mp, "
                             "reinterpret_cast<const uint32_t*>(Qt), zero, ST);\n"),
    "no softmax": (TILE, "  for (int64_t rv = rv0; rv < RV; ++rv) tile_softmax_pairs(ST, Mp, rv * 16, cn, c0, pos, "
                         "masked, m, l, alpha, PP);\n"),
    "no value sums (PV)": (TILE, "  pv_rows_bf16(O, D, alpha + r0, PP + r0, Mp, VP, (cn + 1) / 2, Mp - r0);\n"),
    "no value packing": (TILE, "      tile_value_pairs(P, base, cn, g, VP);\n"),
}


def build(name: str, cut: tuple[str, str] | None):
    d = Path(tempfile.mkdtemp(prefix="tile_parts_"))
    for p in [*CSRC.glob("*.h"), CSRC / "paged_attention.cpp", BINDING]:
        shutil.copy(p, d)
    if cut:
        text = (d / cut[0]).read_text()
        assert text.count(cut[1]) == 1, (name, cut[1])
        (d / cut[0]).write_text(text.replace(cut[1], ";\n"))  # an empty statement in its place
    srcs = [d / BINDING.name, d / "paged_attention.cpp"]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in [*srcs, *d.glob("*.h")])).hexdigest()[:10]
    return load(name=f"tile_parts_{key}", sources=[str(p) for p in srcs], extra_cflags=["-O3", "-march=native",
                "-fopenmp"], extra_ldflags=["-fopenmp"], extra_include_paths=[str(d)])


def main(n: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    H, KVH, D, BS = 9, 3, 64, 16
    blocks = (n + BS - 1) // BS
    k, v = (torch.randn(blocks, BS, KVH, D).to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(blocks).int().view(1, -1)
    q = torch.randn(n, H, D).to(torch.bfloat16)
    lens, starts = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    mods = {name: build(name, cut) for name, cut in CUTS.items()}
    gflop = 4 * H * D * n * n / 2 / 1e9  # causal QK and PV
    for rnd in (1, 2):
        for name, mod in mods.items():
            ts = []
            for _ in range(30):
                t0 = time.perf_counter()
                mod.paged_attention(q, k, v, table, lens, starts, D ** -0.5, n, 1, 1, True)  # tiles, bf16 pairs
                ts.append(time.perf_counter() - t0)
            ts = sorted(ts[2:])
            print(f"round {rnd} {name:20s} min {ts[0] * 1e3:6.2f} ms, median {ts[len(ts) // 2] * 1e3:6.2f} ms"
                  f" ({gflop / ts[0]:.0f} GFLOP/s of the causal products at the min)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1900)
