"""A random bf16 checkpoint of Llama-3.2-3B's shapes (28 layers, hidden 3,072, 24/8 heads of 128, MLP 8,192, tied
embeddings; SmolLM2's tokenizer and 49,152-token vocabulary), written shard by shard with safetensors (no model
object in memory): what loading a model of 3B parameters costs, without a download.
usage: python random_3b.py OUT_DIR   (needs the test extras: the tokenizer files come from the tests' tiny model)"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "tests"))
from conftest import make_tiny_hf_model  # noqa: E402  (the tests' writer, for the config and tokenizer files)

SHAPES = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
              num_key_value_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
              rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02, vocab_size=49152)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    make_tiny_hf_model(str(out), **{**SHAPES, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    for f in out.glob("*.safetensors"):
        f.unlink()
    config = json.loads((out / "config.json").read_text())
    config.update(SHAPES, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h, v, i, layers = 3072, 49152, 8192, 28
    q, kv = 24 * 128, 8 * 128
    names = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        names |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                  p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                  p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                  p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                  p + "mlp.down_proj.weight": (h, i)}
    gen = torch.Generator().manual_seed(0)
    shard, weight_map, index = {}, {}, 0

    def flush() -> None:
        global shard, index
        index += 1
        file = f"model-{index:05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        shard = {}

    for name, shape in names.items():
        t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        shard[name] = t.to(torch.bfloat16)
        if sum(x.numel() for x in shard.values()) > 500_000_000:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    print(out, sum(torch.Size(s).numel() for s in names.values()) / 1e9, "B parameters")
