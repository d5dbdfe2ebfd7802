"""A model's kernel table with the budget given (seconds; 120 for none): the winners per row count.
usage: python full_table.py MODEL BUDGET_S"""
import sys

import torch

from pagedllm.bench.kernels import build_untuned, print_table
from pagedllm.config import EngineConfig
from pagedllm.model import dispatch

torch.set_num_threads(2)
config = EngineConfig(model=sys.argv[1], threads=2)
runner, _ = build_untuned(config)
weights = runner.model.packed_weights()
with torch.inference_mode():
    table = dispatch.measure(weights, runner.model.dtype, budget_s=float(sys.argv[2]))
print("seconds", table.seconds)
print_table(table)
