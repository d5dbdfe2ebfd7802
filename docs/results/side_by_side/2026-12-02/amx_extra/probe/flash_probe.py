"""Probes behind model/attention_sdpa.py (Intel Xeon with AMX, 2 threads): the tiled kernel's two forms against torch's
flash attention through the engine's route, on one prompt and on mixed steps; and what copying keys per query head
costs. Run from the checkout: PYTHONPATH=. python flash_probe.py"""
import math
import time

import torch
import torch.nn.functional as F

from pagedllm.model.attention import AttentionRoute, cpp_attention

torch.set_num_threads(2)
H, KVH, D, BS = 9, 3, 64, 16  # the default model's heads


def tm(f, r=20):
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(r):
        f()
    return round((time.perf_counter() - t) / r * 1e3, 3)


def batch(lens, ns, gen):
    nb = sum(math.ceil(L / BS) for L in lens)
    kc, vc = (torch.randn(nb, BS, KVH, D, generator=gen).bfloat16() for _ in range(2))
    perm = torch.randperm(nb, generator=gen).int()
    bt = torch.zeros(len(lens), max(math.ceil(L / BS) for L in lens), dtype=torch.int32)
    t = 0
    for s, L in enumerate(lens):
        b = math.ceil(L / BS)
        bt[s, :b] = perm[t:t + b]
        t += b
    q = torch.randn(sum(ns), H, D, generator=gen).bfloat16()
    qsl = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), qsl, max(ns)


def route(tile_min_rows, pairs, flash):
    return AttentionRoute(tile_min_rows, tile_min_rows, pairs, False, flash)


gen = torch.Generator().manual_seed(0)
print("one sequence, ms per call: tiles (vdpbf16ps), tiles (fp32), flash attention")
for n, L in [(128, 128), (256, 256), (512, 512), (1024, 1024), (876, 1900), (256, 1900), (64, 1900)]:
    b = batch([L], [n], gen)
    times = [tm(lambda r=r: cpp_attention(*b[:6], D ** -0.5, b[6], r))
             for r in (route(1, True, 0), route(1, False, 0), route(1, False, 1))]
    print(f"  {n} queries, context {L}: {times}")
print("steps, ms per call: one C++ call (tiles from 118 rows) against flash attention for every prompt (100 tokens or more)")
decodes = torch.randint(100, 1000, (100,), generator=gen).tolist()
for name, lens, ns in [("3 prompts of 300 + 100 decodes", [300] * 3 + decodes, [300] * 3 + [1] * 100),
                       ("3 prompts of 300", [300] * 3, [300] * 3), ("100 decodes", decodes, [1] * 100),
                       ("4 prompts of 256", [256] * 4, [256] * 4), ("10 prompts of 100", [100] * 10, [100] * 10),
                       ("1 prompt of 1024", [1024], [1024])]:
    b = batch(lens, ns, gen)
    for rnd in (1, 2):
        times = [tm(lambda r=r: cpp_attention(*b[:6], D ** -0.5, b[6], r))
                 for r in (route(118, False, 0), route(118, False, 100))]
        print(f"  {name} (round {rnd}): {times}")
print("flash attention on a 1,024-token prompt, ms: query heads sharing keys (enable_gqa) against a copy per head")
q = torch.randn(1, H, 1024, D).bfloat16()
k, v = (torch.randn(1024, KVH, D).bfloat16().transpose(0, 1).unsqueeze(0) for _ in range(2))
print("  enable_gqa:", tm(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))
print("  repeat_interleave per call:", tm(lambda: F.scaled_dot_product_attention(
    q, k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1), is_causal=True)))
