"""One sequence's decode attention (9 heads / 3 kv heads x 64, bf16 cache, fp32 query) per call at a few contexts:
warm (the same layer again) and over 30 layers' caches in turn (as a step reads them)."""
import statistics, time, torch
from pagedllm.model import kernels
from pagedllm.model.attention import StepAttention
ext = kernels.load(); torch.set_num_threads(2)
BS, KVH, D, H = 16, 3, 64, 9
for ctx in (16, 300, 1000):
    nb = -(-ctx // BS)
    layers = [(torch.randn(nb * 4, BS, KVH, D).bfloat16(), torch.randn(nb * 4, BS, KVH, D).bfloat16()) for _ in range(30)]
    tables = torch.randperm(nb * 4)[:nb].view(1, nb).int()
    q = torch.randn(1, H, D)
    att = StepAttention.build(torch.float32, D, layers[0][0], tables, torch.tensor([ctx]), torch.tensor([0, 1]), 0.125, 1)
    for _ in range(50): att(q, *layers[0])
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(300): att(q, *layers[0])
        ts.append((time.perf_counter() - t) / 300)
    tl = []
    for _ in range(20):
        t = time.perf_counter()
        for k, v in layers: att(q, k, v)
        tl.append((time.perf_counter() - t) / 30)
    print(f"ctx {ctx:5d}: warm {statistics.median(ts)*1e6:6.1f} us/call, 30 layers in turn {statistics.median(tl)*1e6:6.1f} us/call, "
          f"KV {ctx*KVH*D*2*2/1e3:.0f} KB a layer")
