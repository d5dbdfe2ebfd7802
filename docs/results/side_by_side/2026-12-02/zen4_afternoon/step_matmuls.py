"""A 1,024-token step's layer matmuls (qkv, o, gate_up, down; each kind's fastest path at 1,024 rows, x 30 layers) in
the committed `pagedllm bench kernels` outputs: what model/step_budget.py reads from the engine's kernel table.
usage (repo root): python docs/results/side_by_side/2026-12-02/zen4_afternoon/step_matmuls.py"""
import glob
import re

for path in sorted(glob.glob("docs/results/side_by_side/*/*/bench_kernels.txt")
                   + glob.glob("docs/results/side_by_side/*/*/*/bench_kernels.txt")):
    kind, total, seen = None, 0.0, set()
    for line in open(path):
        if m := re.match(r"^(qkv|o|gate_up|down) \(", line):
            kind = m.group(1)
        elif kind and line.split()[:1] == ["1024"] and kind not in seen:
            times = [float(v) for v in line.split()[1:-1] if v.replace(".", "").isdigit()]
            total, seen = total + min(times), seen | {kind}
    if len(seen) == 4:
        print(f"{path}: {total * 30 / 1000:.0f} ms")
