"""Where int4_q8's time goes on this CPU: the whole call against calls that skip the activations' quantisation (bit 0),
the weights' unpacking (bit 1) or the blocks' sums (bit 2), on the default model's layer shapes; median ms per call,
the variants alternated call by call. A probe build of int4_linear_q8.cpp with those three switches (probe_patch.py).
usage: python probe_patch.py pagedllm/model/csrc DIR && cp bind.cpp DIR && python probe.py DIR ROWS,... REPEATS"""
import statistics
import sys
import time

import torch
from torch.utils.cpp_extension import load

from pagedllm.model import kernels
from pagedllm.model.weight_forms import Int4Weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
MASKS = {"whole": 0, "no_quantize": 1, "no_unpack": 2, "no_sums": 4, "sums_only": 3}


def main() -> None:
    src, rows_list, repeats = sys.argv[1], [int(r) for r in sys.argv[2].split(",")], int(sys.argv[3])
    csrc = kernels.__file__.rsplit("/", 1)[0] + "/csrc"
    probe = load(name="q8probe_" + src.strip("/").replace("/", "_"), sources=[f"{src}/q8probe.cpp", f"{src}/bind.cpp"],
                 extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                 extra_include_paths=[csrc])
    ext = kernels.load()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.02).half().float()
        min_ = (-torch.rand(n, k // 32, generator=g) * 0.16).half().float()
        weight = Int4Weight(q, scale, min_, ext, torch.float32, q8=True)
        layout = weight.f32_layout
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g)
            probe.set_probe(0)
            assert torch.equal(probe.int4_linear_q8(x, *layout), weight.mm_q8(x)), "probe build differs"
            times = {m: [] for m in MASKS}
            for _ in range(repeats):
                for m, mask in MASKS.items():
                    probe.set_probe(0)
                    probe.int4_linear_q8(x, *layout)  # fresh buffers for the skipping call
                    probe.set_probe(mask)
                    t = time.perf_counter()
                    probe.int4_linear_q8(x, *layout)
                    times[m].append(time.perf_counter() - t)
            med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
            w = med["whole"]
            print(f"{name:8s} rows {rows:5d}  whole {w:8.3f}  quantize {w - med['no_quantize']:7.3f}  "
                  f"unpack {w - med['no_unpack']:7.3f}  sums {w - med['no_sums']:7.3f}  sums_only {med['sums_only']:7.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
