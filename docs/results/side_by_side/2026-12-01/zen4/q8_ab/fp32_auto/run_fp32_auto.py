"""`pagedllm bench throughput` with `--dtype auto` made to choose fp32 arithmetic (bf16_choice.bf16_pays -> False), as
on a CPU where bf16 matmuls are slow: what the 4-bit weights against int8 activations give there (usage: python
run_fp32_auto.py BENCH-ARGS...)."""
import sys

from pagedllm.entrypoints import cli
from pagedllm.model import bf16_choice

bf16_choice.bf16_pays = lambda *a, **k: False
sys.exit(cli.main(["bench", "throughput", *sys.argv[1:]]))
