"""A random model of Llama-3.2-1B's shapes (16 layers, hidden 2,048, 32/8 heads of 64, MLP 8,192, tied embeddings;
SmolLM2's tokenizer and 49,152-token vocabulary), as a Hugging Face folder (fp32, for vLLM and pagedllm's bf16 path)
and a Q4_1 GGUF (pagedllm's default 4-bit path): speed checks on a model 8x the default's size without a download.
Speed does not depend on the weights' values, but n-gram speculation does (a random model's greedy text repeats
differently): compare with `--num-speculative-tokens 0` too.
usage: python docs/scripts/random_llama.py OUT_DIR   (OUT_DIR/hf and OUT_DIR/model-Q4_1.gguf; needs the test extras)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_tiny_hf_model, write_gguf  # noqa: E402  (the tests' writers, at a bigger size)

SHAPES = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=8192,
              rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    hf = make_tiny_hf_model(str(out / "hf"), **SHAPES)
    print(write_gguf(hf, str(out / "model-Q4_1.gguf"), quant="Q4_1"))
