"""128 requests sharing a 1,000-token prefix, each with its own 8-40 random tokens after it, 64 output tokens: after
the first, each prompt's new part is a short chunk over a cached prefix (8-40 queries x 3 query heads per kv head).
usage: python shared_prefix_workload.py OUT.jsonl"""
import json
import random
import sys

r = random.Random(0)
prefix = [r.randrange(1000, 40000) for _ in range(1000)]
with open(sys.argv[1], "w") as f:
    for _ in range(128):
        suffix = [r.randrange(1000, 40000) for _ in range(r.randint(8, 40))]
        f.write(json.dumps({"prompt_token_ids": prefix + suffix, "output_len": 64}) + "\n")
