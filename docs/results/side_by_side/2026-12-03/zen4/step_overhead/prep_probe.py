"""ModelRunner.prepare for 1, 4 and 64 sequences (decodes, 4-token drafts): its time per call, with a stand-in runner."""
import sys, time, types
import torch
from pagedllm.core.plan import ScheduledSeq, SchedulerOutput
from pagedllm.model.model_runner import ModelRunner
torch.set_num_threads(2)

class Seq:
    def __init__(self, n):
        self.token_ids = list(range(n)); self.lora_int_id = 0

def plan(S, ctx, draft):
    out = SchedulerOutput(budget=0)
    for i in range(S):
        s = Seq(ctx)
        out.scheduled.append(ScheduledSeq(s, ctx - 1, 1 + len(draft), list(range(i * 40, i * 40 + (ctx + 20) // 16)),
                                          samplers=[s], draft=list(draft)))
    return out

runner = types.SimpleNamespace(block_size=16, model=types.SimpleNamespace(lora=None))
runner.logit_rows = ModelRunner.logit_rows
runner.lora_batch = lambda scheduled, lens: ModelRunner.lora_batch(runner, scheduled, lens)
for S, draft in ((1, []), (1, [5, 6, 7, 8]), (4, [5, 6, 7, 8]), (64, []), (64, [5, 6])):
    p = plan(S, 300, draft)
    for _ in range(200): ModelRunner.prepare(runner, p)
    t = time.perf_counter()
    for _ in range(2000): ModelRunner.prepare(runner, p)
    print(f"S {S:3d} draft {len(draft)}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us")
