"""What a seeded row's generator costs per step (ModelRunner.row_generators: a torch.Generator seeded by
seed_at(seed, position)), against drawing its uniform from one generator per sequence as before.
Run: python seeded_rows_cost.py"""

import time

import torch

from pagedllm.model.sampler import seed_at

rows = 6400
start = time.perf_counter()
for i in range(rows):
    torch.Generator().manual_seed(seed_at(7, i))
made = (time.perf_counter() - start) / rows * 1e6
generator, u = torch.Generator().manual_seed(3), torch.empty(64)
start = time.perf_counter()
for i in range(rows):
    u[i % 64].uniform_(generator=generator)
drawn = (time.perf_counter() - start) / rows * 1e6
print(f"a generator per seeded row and step: {made:.1f} us a row; a uniform from one generator: {drawn:.1f} us a row")
