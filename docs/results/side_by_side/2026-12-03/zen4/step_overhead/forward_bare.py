"""A batch-1 decode forward: model.forward against the same C++ kernels called bare (no Python wrappers)."""
import sys, time, torch
from pagedllm import LLM
from pagedllm.model.llama import AttentionMetadata
if __name__ == "__main__":
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    llm = LLM(threads=2, num_speculative_tokens=0, kv_cache_memory=1 << 28)
    runner = llm.engine.runner; model = runner.model; ext = model.ext; c = model.config
    kv = runner.kv_caches; B = kv[0][0].shape[1]
    nblk = (ctx + B - 1) // B
    tables = torch.arange(nblk, dtype=torch.int32)[None]
    meta = AttentionMetadata(slot_mapping=torch.tensor([ctx - 1]), block_tables=tables,
                             context_lens=torch.tensor([ctx], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32), max_query_len=1)
    ids = torch.tensor([42]); pos = torch.tensor([ctx - 1])
    route = model.attention_route
    def bare():
        eps = c.rms_norm_eps
        res = torch.nn.functional.embedding(ids, model.embed); delta = None
        for L, (kc, vc) in zip(model.layers, kv):
            x = ext.add_rms_norm(delta, res, L.input_norm, eps)
            qkv = ext.int4_linear(x, *L.qkv_weight.int4.form)
            h = qkv.view(1, -1, c.head_dim)
            q, k, v = h[:, :9], h[:, 9:12], h[:, 12:]
            ext.rotary_(q, model.rotary.cos, model.rotary.sin, pos); ext.rotary_(k, model.rotary.cos, model.rotary.sin, pos)
            ext.write_kv(k, v, kc, vc, meta.slot_mapping)
            o = ext.paged_attention(q, kc, vc, tables, meta.context_lens, meta.query_start_loc, model.scale, 1,
                                    route.tile_min_rows, route.few_tile_min_rows, route.tile_pairs, route.tile_f16)
            delta = ext.int4_linear(o.view(1, -1), *L.o_weight.int4.form)
            x = ext.add_rms_norm(delta, res, L.post_norm, eps)
            g = ext.silu_mul(ext.int4_linear(x, *L.gate_up_weight.int4.form))
            delta = ext.int4_linear(g, *L.down_weight.int4.form)
        return ext.add_rms_norm(delta, res, model.norm, eps)
    full = lambda: model.forward(ids, pos, meta, kv)
    with torch.inference_mode():
        for name, f in [("forward", full), ("bare", bare)] * 3:
            for _ in range(20): f()
            t = time.perf_counter()
            for _ in range(200): f()
            print(f"ctx {ctx} {name}: {(time.perf_counter() - t) / 200 * 1e3:.3f} ms", flush=True)
