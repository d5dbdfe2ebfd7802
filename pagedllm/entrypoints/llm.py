"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.model.tokenizer import Tokenizer

PromptType = str | list[int] | dict


class LLM:
    """Batch generation over the engine: every prompt is queued at once and continuous batching runs them."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        config = EngineConfig(model=model, **engine_args)
        with seconds_counter(f"Loading {model or 'the default model'}"):
            self.engine = LLMEngine(config)
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; prompts are text, token ids or {"prompt_token_ids": [...]}.
        `priority`, one per prompt (lower first), counts under scheduling_policy="priority", as vLLM's;
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts))
        priorities = self._per_prompt(priority, len(prompts), "priorities")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else self._per_prompt(lora_request, len(prompts), "LoRA requests")
        ids: list[str] = []
        try:
            for prompt, p, rank, lora in zip(prompts, params, priorities, loras):
                ids.append(self._add(prompt, p, rank, lora))
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

    def beam_search(self, prompts: list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: every step, each live beam is a one-token request asking for its top 2 * width
        logprobs; the prefix cache shares the beams' common blocks (ref counts), so a beam that forks costs only
        its last partial block, and a beam that dies just lets its blocks go. `use_tqdm`: a bar over the steps (off
        by default, as vLLM's)."""
        eos = self.get_tokenizer().eos_token_id
        step_params = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width,
                                     ignore_eos=True)
        beams = [[BeamSearchSequence(self._prompt_ids(p))] for p in self._as_prompt_list(prompts)]
        done: list[list[BeamSearchSequence]] = [[] for _ in beams]
        starts = [len(b[0].tokens) for b in beams]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm,
                      dynamic_ncols=True):
            live = [beam for group in beams for beam in group]
            if not live:
                break
            outs = iter(self.generate([{"prompt_token_ids": b.tokens} for b in live], step_params, use_tqdm=False))
            for i, group in enumerate(beams):
                candidates = []
                for beam in group:
                    for token, lp in next(outs).outputs[0].logprobs[0].items():
                        new = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + lp.logprob)
                        if token == eos and not params.ignore_eos:
                            new.finished = True
                            done[i].append(new)
                        else:
                            candidates.append(new)
                candidates.sort(key=lambda b: self._beam_score(b, params.length_penalty), reverse=True)
                beams[i] = candidates[:params.beam_width]
        tok = self.get_tokenizer()
        results = []
        for start, group, finished in zip(starts, beams, done):
            best = sorted(finished + group, key=lambda b: self._beam_score(b, params.length_penalty), reverse=True)
            for beam in best[:params.beam_width]:
                beam.text = tok.decode(beam.tokens[start:])
            results.append(BeamSearchOutput(best[:params.beam_width]))
        return results

    @staticmethod
    def _beam_score(beam: BeamSearchSequence, length_penalty: float) -> float:
        """vLLM's: cumulative logprob over (length, EOS excluded) ** length_penalty, the length counting the prompt."""
        return beam.cum_logprob / ((len(beam.tokens) - beam.finished) ** length_penalty)

    def _prompt_ids(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict):
            return list(prompt["prompt_token_ids"])
        return self.engine.tokenize_prompt(prompt)

    @staticmethod
    def _per_prompt(values: Seq | None, n: int, what: str) -> list:
        values = list(values) if values is not None else [None] * n
        if len(values) != n:
            raise ValueError(f"got {len(values)} {what} for {n} prompts")
        return values

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int | None = None,
             lora_request: LoRARequest | None = None) -> str:
        request_id = str(self._counter)
        self._counter += 1
        if isinstance(prompt, dict):
            seq = self.engine.add_request(request_id, prompt["prompt_token_ids"], params, priority=priority,
                                          lora_request=lora_request)
            seq.prompt = prompt.get("prompt")
        else:
            self.engine.add_request(request_id, prompt, params, priority=priority, lora_request=lora_request)
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


@contextlib.contextmanager
def seconds_counter(what: str, interval: float = 0.5) -> Iterator[None]:
    """`what: 3.5s` on stderr, counting while the block runs (loading a model takes seconds with no other sign of
    life); a terminal only, as tqdm decides."""
    bar = tqdm(total=None, desc=what, bar_format="{desc}: {elapsed}", disable=None, leave=False)
    if bar.disable:
        yield
        return
    done = threading.Event()

    def tick() -> None:
        while not done.wait(interval):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="pagedllm-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()
