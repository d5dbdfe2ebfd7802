"""Offline workload, step by step: where the time goes, by step size (decode rows) and by part."""
import json, sys, time, collections
from pagedllm import LLM, SamplingParams
W = sys.argv[1]
reqs = [json.loads(line) for line in open(W)]
llm = LLM(threads=2)
eng = llm.engine; eng.wait_for_kv_cache()
for i, r in enumerate(reqs):
    ids = r.get("prompt_token_ids") or eng.tokenize_prompt(r["prompt"])
    n = r.get("output_len") or r.get("max_tokens")
    eng.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
stats = collections.Counter()
_sched = eng.scheduler.schedule
def sched():
    p = _sched()
    for x in p.scheduled:
        if x.samplers and x.num_new_tokens == 1 + len(x.draft):
            stats['decode_rows'] += x.num_new_tokens; stats['draft_rows'] += len(x.draft); stats['decode_seqs'] += 1
        else:
            stats['prompt_rows'] += x.num_new_tokens
    return p
eng.scheduler.schedule = sched
buckets = collections.defaultdict(lambda: [0, 0.0, 0])  # steps, seconds, tokens
t0 = time.perf_counter(); tot = 0; kws = []
with eng.step_timers() as timers:
    while eng.has_unfinished_requests():
        running = len(eng.scheduler.running)
        g0 = eng.num_generated_tokens
        kw0 = timers.seconds['kv_write']; s = time.perf_counter(); eng.step(); d = time.perf_counter() - s
        kws.append((timers.seconds['kv_write'] - kw0, d, running, eng.num_generated_tokens - g0))
        b = 1 << max(0, (running - 1)).bit_length() if running else 0
        buckets[b][0] += 1; buckets[b][1] += d; buckets[b][2] += eng.num_generated_tokens - g0
wall = time.perf_counter() - t0
print(f"wall {wall:.1f} s, tokens {eng.num_generated_tokens}")
for b in sorted(buckets):
    st, sec, tok = buckets[b]
    print(f"running<= {b:4d}: steps {st:5d}  {sec:6.2f} s ({100*sec/wall:4.1f}%)  {1000*sec/st:6.1f} ms/step  tok {tok}")
print(json.dumps({k: round(v, 2) for k, v in timers.seconds.items()} if hasattr(timers, 'seconds') else str(vars(timers))))
kws.sort(reverse=True)
for x in kws[:15]: print('kv_write %.1f ms of step %.1f ms, running %d, tokens %d' % (x[0]*1e3, x[1]*1e3, x[2], x[3]))
print('calls', timers.calls)
print('prefault', eng.runner.prefault.__dict__.keys())
print(dict(stats))
