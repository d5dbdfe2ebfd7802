"""Per-call cost of each forward wrapper at 1 row, against its bare C++ call."""
import time, torch
from pagedllm import LLM
from pagedllm.model.llama import AttentionMetadata
from pagedllm.model.layers import linear, add_rms_norm
from pagedllm.model.attention import write_kv, paged_attention
def us(f, n=5000):
    for _ in range(200): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
if __name__ == "__main__":
    llm = LLM(threads=2, num_speculative_tokens=0, kv_cache_memory=1 << 28)
    runner = llm.engine.runner; model = runner.model; ext = model.ext; c = model.config
    kc, vc = runner.kv_caches[0]; L = model.layers[0]
    ctx = 16
    tables = torch.arange(1, dtype=torch.int32)[None]
    meta = AttentionMetadata(slot_mapping=torch.tensor([ctx - 1]), block_tables=tables,
                             context_lens=torch.tensor([ctx], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32), max_query_len=1)
    pos = torch.tensor([ctx - 1]); route = model.attention_route
    x = torch.randn(1, 576).bfloat16(); res = torch.randn(1, 576).bfloat16()
    qkv = torch.randn(1, 960).bfloat16()
    with torch.inference_mode():
        rows = [
          ("linear o", lambda: linear(x, L.o_weight), lambda: ext.int4_linear(x, *L.o_weight.int4.form)),
          ("model._linear o", lambda: model._linear(x, L.o_weight, None, 0, "o", None), lambda: ext.int4_linear(x, *L.o_weight.int4.form)),
          ("add_rms_norm", lambda: add_rms_norm(x, res, L.input_norm, 1e-5, ext), lambda: ext.add_rms_norm(x, res, L.input_norm, 1e-5)),
          ("split+views", lambda: [t.view(1, -1, 64) for t in qkv.split([576, 192, 192], dim=-1)], lambda: qkv.view(1, 15, 64)),
          ("rotary", lambda: model.rotary(pos, qkv[:, :576].view(1, 9, 64), qkv[:, 576:768].view(1, 3, 64), ext),
                     lambda: ext.rotary_(qkv.view(1, 15, 64)[:, :12], model.rotary.cos, model.rotary.sin, pos)),
          ("write_kv", lambda: write_kv(qkv[:, 576:768].view(1, 3, 64), qkv[:, 768:].view(1, 3, 64), kc, vc, meta.slot_mapping, ext),
                       lambda: ext.write_kv(qkv[:, 576:768].view(1, 3, 64), qkv[:, 768:].view(1, 3, 64), kc, vc, meta.slot_mapping)),
          ("attention", lambda: paged_attention(qkv[:, :576].view(1, 9, 64), kc, vc, tables, meta.context_lens, meta.query_start_loc, 0.125, 1, route=route),
                        lambda: ext.paged_attention(qkv[:, :576].view(1, 9, 64), kc, vc, tables, meta.context_lens, meta.query_start_loc, 0.125, 1, route.tile_min_rows, route.few_tile_min_rows, route.tile_pairs, route.tile_f16)),
          ("silu_mul", lambda: ext.silu_mul(torch.empty(1, 3072, dtype=torch.bfloat16)), lambda: None),
          ("qkv slice+view", lambda: qkv[:, 576:768].view(1, 3, 64), lambda: None),
          ("empty", lambda: torch.empty(1, 576, dtype=torch.bfloat16), lambda: None),
        ]
        for name, a, b in rows:
            print(f"{name:18s} wrapped {us(a):6.2f} us   bare {us(b):6.2f} us", flush=True)
