"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer

PromptType = str | list[int] | dict


class LLM:
    """Batch generation over the engine: every prompt is queued at once and continuous batching runs them."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; prompts are text, token ids or {"prompt_token_ids": [...]}."""
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts))
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self._add(prompt, p))
            finished = self._run(len(ids), use_tqdm)
        except BaseException:  # a bad prompt or an interrupt: nothing stays queued, no block stays taken
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        texts = [tok.apply_chat_template(c, add_generation_prompt) for c in conversations]
        prompts = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        request_id = str(self._counter)
        self._counter += 1
        if isinstance(prompt, dict):
            seq = self.engine.add_request(request_id, prompt["prompt_token_ids"], params)
            seq.prompt = prompt.get("prompt")
        else:
            self.engine.add_request(request_id, prompt, params)
        return request_id

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return finished

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    @staticmethod
    def _as_params_list(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params
