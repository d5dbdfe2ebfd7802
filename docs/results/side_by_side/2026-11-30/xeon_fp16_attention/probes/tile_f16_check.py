"""fp16-products tile against float64: error vs the fp32 tile's and vs bf16-rounded queries; speed.

    python tile_f16_check.py N [Q_SCALE KV_SCALE]   (N prompt tokens; run from /tmp with PYTHONSAFEPATH=1)

On 2026-11-30 at 04d2a68 (Intel Xeon model 207, AVX512-FP16, nothing else running):
  n=1900: fp32 tile 21.48 ms, f16 tile 14.60 ms, 1.47x; n=512: 1.88 against 1.37 ms, 1.38x
  errors against float64 (n=512): fp32 tile 6.3e-7, f16 tile 2.7e-3, bf16-rounded queries (exact) 2.9e-3
"""
import sys, time, torch
from pagedllm.model.attention import cpp_attention, AttentionRoute
torch.manual_seed(0)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
scale_q = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
scale_kv = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
H, KVH, D, BS = 9, 3, 64, 16
nb = (n + BS - 1) // BS
kc = (torch.randn(nb, BS, KVH, D) * scale_kv).to(torch.bfloat16); vc = (torch.randn(nb, BS, KVH, D) * scale_kv).to(torch.bfloat16)
table = torch.randperm(nb).to(torch.int32).unsqueeze(0)
lens = torch.tensor([n], dtype=torch.int32); starts = torch.tensor([0, n], dtype=torch.int32)
q = torch.randn(n, H, D) * 3 * scale_q
def ref(qq):
    k = kc[table[0].long()].reshape(-1, KVH, D)[:n].double().repeat_interleave(3, 1)
    v = vc[table[0].long()].reshape(-1, KVH, D)[:n].double().repeat_interleave(3, 1)
    s = torch.einsum("qhd,khd->hqk", qq.double(), k) * D ** -0.5
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
r = ref(q)
f32 = cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, AttentionRoute(1, 1, True, False))
f16 = cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, AttentionRoute(1, 1, True, True))
rb = ref(q.bfloat16().float())
rh = ref(q.half().float()) if scale_q == 1 else r
for name, x in [("fp32 tile", f32), ("f16 tile", f16), ("bf16-rounded q (exact)", rb), ("fp16-rounded q (exact)", rh)]:
    e = (x.double() - r).abs()
    print(f"{name}: max err {e.max().item():.3e}, mean {e.mean().item():.3e}, rel {(e.norm() / r.norm()).item():.3e}, finite {bool(torch.isfinite(x).all())}")
def t(route, reps=5):
    cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route)
    best = 1e9
    for _ in range(reps):
        s = time.perf_counter(); cpp_attention(q, kc, vc, table, lens, starts, D ** -0.5, n, route); best = min(best, time.perf_counter() - s)
    return best
a, b = t(AttentionRoute(1, 1, True, False)), t(AttentionRoute(1, 1, True, True))
print(f"n={n}: fp32 tile {a*1e3:.2f} ms, f16 tile {b*1e3:.2f} ms, {a/b:.2f}x")
