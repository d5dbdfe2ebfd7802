"""The default model's own logits for the sampler probes (sampler_calls.py, sampled_parts.py): the first 64 requests
of a workload sampled at temperature 0.8, top_p 0.95 for 8 tokens, and the last 64 rows the sampler saw (decode
rows)."""

import json

import torch

import pagedllm.model.model_runner as model_runner
from pagedllm import LLM, SamplingParams


def decode_logits(workload_path: str, rows: int = 64) -> torch.Tensor:
    captured = []
    real_sample = model_runner.sample
    model_runner.sample = lambda logits, batch, rng, ext: captured.append(logits.clone()) or real_sample(
        logits, batch, rng, ext)
    try:
        prompts = [json.loads(line)["prompt_token_ids"] for line in open(workload_path)][:rows]
        LLM().generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0), use_tqdm=False)
    finally:
        model_runner.sample = real_sample
    return torch.cat(captured)[-rows:].contiguous()
