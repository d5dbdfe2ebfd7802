"""llguidance and xgrammar side by side on one tokenizer and one JSON schema (docs/structured-outputs.md): compile
time, the time to fill one row's token mask, and whether random walks under each mask end as valid JSON.

A random walk draws random logits each step, masks them with the backend's bitmask and takes the argmax: any token
the grammar allows is equally likely, so the walk probes the whole grammar rather than the text a model would write.
Both produce compact JSON (no whitespace between tokens: otherwise random walks wander in whitespace until
the token limit). An output counts as valid when `json.loads` (strict: no raw control characters inside strings)
reads it and it validates against the schema.

usage (a venv with torch, transformers, llguidance, xgrammar and jsonschema; not the project's):
    python docs/scripts/grammar_backends.py HF_TOKENIZER_DIR [--walks 60] [--max-tokens 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedllm.bench.structured import SCHEMA as OPEN_SCHEMA  # noqa: E402  (`pagedllm bench structured`'s)
from pagedllm.engine.structured_output import close_objects  # noqa: E402

SCHEMA = close_objects(OPEN_SCHEMA)  # no extra keys, as the engine (and OpenAI's strict mode) has it


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llg, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.bitmask = self.lt.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matcher: Any) -> None:
        self.lt.fill_next_token_bitmask(matcher, self.bitmask, 0)

    def apply(self, logits: torch.Tensor) -> None:
        self.lt.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        matcher.consume_token(token)
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size),
                                            cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict) -> Any:
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))

    def fill(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def apply(self, logits: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        assert matcher.accept_token(token)
        return matcher.is_terminated()


def problem(text: str) -> str | None:
    """Why the text is not a valid instance of the schema, or None."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return None
    except json.JSONDecodeError as e:
        return f"JSON: {e}"
    except jsonschema.ValidationError as e:
        return f"schema: {e.message[:120]}"


def run(backend: Any, tokenizer: Any, vocab_size: int, walks: int, max_tokens: int) -> dict[str, Any]:
    compile_ms = []
    for i in range(5):
        start = time.perf_counter()
        backend.compile({**SCHEMA, "title": f"cold-{i}"})  # a new text each time: no cache can answer
        compile_ms.append((time.perf_counter() - start) * 1e3)
    fill_us: list[float] = []
    ok = ended = 0
    bad: list[str] = []
    eos = tokenizer.eos_token_id
    for walk in range(walks):
        matcher, tokens = backend.compile(SCHEMA), []
        gen = torch.Generator().manual_seed(walk)
        for _ in range(max_tokens):
            start = time.perf_counter()
            backend.fill(matcher)
            fill_us.append((time.perf_counter() - start) * 1e6)
            logits = torch.randn(1, vocab_size, generator=gen)
            backend.apply(logits)
            token = int(logits.argmax())
            tokens.append(token)
            if backend.accept(matcher, token):
                ended += 1
                break
        text = tokenizer.decode([t for t in tokens if t != eos])
        why = problem(text)
        ok += why is None
        if why is not None and len(bad) < 3:
            bad.append(why)
    return {"backend": backend.name, "compile_cold_ms_median": round(statistics.median(compile_ms), 2),
            "fill_us_median": round(statistics.median(fill_us), 1),
            "fill_us_p99": round(statistics.quantiles(fill_us, n=100)[98], 1), "walks": walks,
            "walks_ended_by_grammar": ended, "valid_json": ok, "invalid_examples": bad}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer_dir")
    p.add_argument("--walks", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--backends", default="llguidance,xgrammar")
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    vocab_size = len(tokenizer)
    for name in args.backends.split(","):
        backend = {"llguidance": Llguidance, "xgrammar": Xgrammar}[name](tokenizer, vocab_size)
        print(json.dumps(run(backend, tokenizer, vocab_size, args.walks, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
