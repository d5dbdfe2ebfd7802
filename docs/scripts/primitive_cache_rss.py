"""What oneDNN's primitive cache holds in memory: the default model's four layer shapes (fp32, packed as the engine
packs them) at N new row counts each, in a process whose cache holds CAPACITY primitives; prints the RSS grown. Run
it at 32 and 512: the difference is what a bigger cache keeps (the rest is the heap the calls' outputs leave).

    python docs/scripts/primitive_cache_rss.py CAPACITY [N]     # e.g. 32 250, then 512 250
"""

from __future__ import annotations

import os
import sys

os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = sys.argv[1]  # read at oneDNN's first primitive: before any matmul

import torch  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: outputs x inputs


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 250
    torch.set_num_threads(2)
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k)) for n, k in SHAPES]
    x = torch.randn(count + 3, max(k for _, k in SHAPES))

    def run(rows: int) -> None:
        for w, (_, k) in zip(weights, SHAPES):
            torch.ops.mkldnn._linear_pointwise(x[:rows, :k].contiguous(), w, None, "none", [], "")

    for rows in (1, 2):  # oneDNN's own start-up out of the count
        run(rows)
    before = rss_mib()
    for rows in range(3, 3 + count):
        run(rows)
    print(f"capacity {sys.argv[1]}: RSS +{rss_mib() - before:.1f} MiB over {len(SHAPES) * count} new shapes")


if __name__ == "__main__":
    main()
