"""`pagedllm bench accuracy` with `--dtype auto` made to choose fp32 arithmetic (bf16_choice.bf16_pays -> False), as on
a CPU where bf16 matmuls are slow: its "defaults (dtype auto)" row then runs the measured routes' int8 activations
(usage: python gate_fp32_auto.py [BENCH-ARGS...])."""
import sys

from pagedllm.entrypoints import cli
from pagedllm.model import bf16_choice

bf16_choice.bf16_pays = lambda *a, **k: False
sys.exit(cli.main(["bench", "accuracy", *sys.argv[1:]]))
