import time, math, torch
import torch.nn.functional as F
torch.set_num_threads(2)
from pagedllm.model import attention_sdpa as A
from pagedllm.model.attention import _reference_attention
def tm(f, r=10):
    for _ in range(3): f()
    t = time.perf_counter()
    for _ in range(r): f()
    return round((time.perf_counter()-t)/r*1e3, 3)
op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
H, KVH, D, BS = 9, 3, 64, 16
def split_seq(q, k_cache, v_cache, table, context, scale):
    n, heads, head_dim = q.shape
    blocks = table[: math.ceil(context / k_cache.shape[1])].long()
    g = heads // k_cache.shape[2]
    k, v = (cache[blocks].flatten(0, 1)[:context].transpose(0, 1).unsqueeze(1).expand(-1, g, -1, -1).reshape(1, heads, context, head_dim) for cache in (k_cache, v_cache))
    qq = q.transpose(0, 1).unsqueeze(0)
    own, own_lse = op(qq, k[:, :, context - n:], v[:, :, context - n:], 0.0, True, scale=scale)
    past, past_lse = op(qq, k[:, :, :context - n], v[:, :, :context - n], 0.0, False, scale=scale)
    top = torch.maximum(own_lse, past_lse)
    w_own, w_past = (own_lse - top).exp_(), (past_lse - top).exp_()
    tot = w_own + w_past
    merged = own.float().mul_((w_own / tot)[..., None]).add_(past.float().mul_((w_past / tot)[..., None]))
    return merged[0].transpose(0, 1).to(q.dtype)
for n, L in [(876, 1900), (1024, 2048), (512, 1900), (876, 1000)]:
    nb = math.ceil(L / BS)
    kc = torch.randn(nb + 5, BS, KVH, D).bfloat16(); vc = torch.randn(nb + 5, BS, KVH, D).bfloat16()
    bt = torch.randperm(nb + 5)[:nb].int()
    q = torch.randn(n, H, D).bfloat16()
    a = A._sequence(q, kc, vc, bt, L, 0.125); b = split_seq(q, kc, vc, bt, L, 0.125)
    ref = _reference_attention(q, kc, vc, bt[None], torch.tensor([L]), torch.tensor([0, n]), 0.125)
    print(n, L, "mask", tm(lambda: A._sequence(q, kc, vc, bt, L, 0.125)), "split", tm(lambda: split_seq(q, kc, vc, bt, L, 0.125)),
          "err", round((a.float()-ref.float()).abs().max().item(), 4), round((b.float()-ref.float()).abs().max().item(), 4))
