"""In fp32 the default model's greedy JSON answers (structured_drafts.py's four requests) are the same tokens with
drafts (4, every step verifies them) as without: the check that the draft rows' grammar masks are right on the real
model. Run: python structured_fp32_check.py"""

from make_edit_requests import PARAGRAPHS

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema))
runs = []
for drafts in (0, 4):
    llm = LLM(dtype="float32", num_speculative_tokens=drafts, speculative_disable_by_batch_size=256)
    tokenizer = llm.get_tokenizer()
    prompts = []
    for paragraph in PARAGRAPHS:
        ask = f'Put the following text in a JSON object with one key, "text", copying it exactly:\n\n{paragraph}'
        text = tokenizer.apply_chat_template([{"role": "user", "content": ask}])
        prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    print(f"drafts {drafts}: {llm.engine.num_draft_tokens} proposed, {llm.engine.num_accepted_tokens} kept; "
          f"{sum(map(len, runs[-1]))} output tokens")
print("same tokens:", runs[0] == runs[1], [a == b for a, b in zip(*runs)])
