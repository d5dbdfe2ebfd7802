"""The numpy prepare gives the torch one's tensors (values and dtypes), and its time per call against it.
Usage: PYTHONPATH=NEW python prep_equal.py OLD/pagedllm/model/model_runner.py (OLD: a checkout at 138e75f)."""
import importlib.util, pathlib, sys, time, types
import torch
old_path = sys.argv[1]
exec(pathlib.Path(__file__).with_name("prep_probe.py").read_text().split("for S, draft in")[0])
spec = importlib.util.spec_from_file_location("old_runner", old_path)
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
def stand_in(cls):
    r = types.SimpleNamespace(block_size=16, model=types.SimpleNamespace(lora=None))
    r.logit_rows = cls.logit_rows
    r.lora_batch = lambda scheduled, lens: cls.lora_batch(r, scheduled, lens)
    return r
new_r, old_r = stand_in(ModelRunner), stand_in(old.ModelRunner)
for S, draft in ((1, []), (1, [5, 6, 7, 8]), (4, [5, 6, 7, 8]), (64, []), (64, [5, 6])):
    p = plan(S, 300, draft)
    p.scheduled[0].draft, p.scheduled[0].num_new_tokens = [], 1  # a row without a draft among rows with
    a, b = ModelRunner.prepare(new_r, p), old.ModelRunner.prepare(old_r, p)
    for x, y in [(a[0], b[0]), (a[1], b[1]), (a[3], b[3])] + [(getattr(a[2], f), getattr(b[2], f)) for f in ("slot_mapping", "block_tables", "context_lens", "query_start_loc")]:
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)
    assert a[2].max_query_len == b[2].max_query_len
    times = []
    for fn, r in ((ModelRunner.prepare, new_r), (old.ModelRunner.prepare, old_r)):
        for _ in range(100): fn(r, p)
        t = time.perf_counter()
        for _ in range(1000): fn(r, p)
        times.append((time.perf_counter() - t) / 1000 * 1e6)
    print(f"S {S:3d} draft {len(draft)}: numpy {times[0]:.1f} us, torch {times[1]:.1f} us (equal)")
