"""Bytes of a bf16 model's two 4-bit forms after its build (the bf16 kernel's and the fp16 products' packing), and
the forms each kind kept. Run: PYTHONPATH=TREE python form_bytes.py"""
from pagedllm import LLM

llm = LLM(dtype="bfloat16", threads=2, kv_cache_memory="64MiB")
weights = llm.engine.runner.model.packed_weights()
ws = [w for ws in weights.values() for w in ws if w.int4 is not None]


def nbytes(form):
    return sum(t.numel() * t.element_size() for t in form) if form else 0


print(f"{len(ws)} weights with 4-bit forms: bf16 kernel's {sum(nbytes(w.int4.form) for w in ws) / 2**20:.1f} MiB, "
      f"fp16 products' {sum(nbytes(w.int4.f16_form) for w in ws) / 2**20:.1f} MiB")
print({kind: sorted(ws[0].paths()) for kind, ws in weights.items()})
