"""Output tokens/s of JSON requests that quote their prompt (each of make_edit_requests.py's four paragraphs, to be
returned as {"text": ...} under that JSON schema), one after another, three times each, with n-gram drafts on (4) or
off (0), greedy or sampled (temperature 0.8, top_p 0.95), on whichever pagedllm is first on PYTHONPATH.
Run: python structured_drafts.py DRAFTS TEMPERATURE
"""

import sys
import time

from make_edit_requests import PARAGRAPHS

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

drafts, temperature = int(sys.argv[1]), float(sys.argv[2])
llm = LLM(num_speculative_tokens=drafts)
tokenizer = llm.get_tokenizer()
schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=200,
                        structured_outputs=StructuredOutputsParams(json=schema))
prompts = []
for paragraph in PARAGRAPHS:
    ask = f'Put the following text in a JSON object with one key, "text", copying it exactly:\n\n{paragraph}'
    text = tokenizer.apply_chat_template([{"role": "user", "content": ask}])
    prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: the grammar compiled, first-step costs off the clock
engine = llm.engine
before = engine.num_draft_tokens, engine.num_accepted_tokens
start = time.perf_counter()
outs = [out for _ in range(3) for prompt in prompts for out in llm.generate([prompt], params, use_tqdm=False)]
elapsed = time.perf_counter() - start
n = sum(len(o.outputs[0].token_ids) for o in outs)
proposed, kept = engine.num_draft_tokens - before[0], engine.num_accepted_tokens - before[1]
stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
print(f"drafts {drafts}, temperature {temperature}: {n} output tokens in {elapsed:.1f} s, {n / elapsed:.1f} tokens/s; "
      f"{proposed} tokens proposed, {kept} kept; {stopped} of {len(outs)} complete JSON")
