"""Benchmark workloads, deterministic given a seed: the vLLM paper's datasets reshaped for a CPU.

ShareGPT- and Alpaca-like requests keep the traces' length distributions (long-tailed conversations, short narrow
instructions), scaled so that 2 cores serve a run in minutes; their prompts are real English cut from the docstrings
of the Python standard library, so tokenization is realistic and nothing is downloaded. Plus random token ids
(vLLM's 'random' dataset), a shared few-shot prefix, parallel sampling, beam search, and requests read from a file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "sharegpt", "alpaca", "shared-prefix", "parallel-sampling", "beam-search", "file")


@dataclass
class BenchRequest:
    prompt: str  # the prompt text (decoded from the ids if the ids came first)
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate (benchmarks run with ignore_eos, max_tokens=output_len)
    n: int = 1  # parallel sampling: samples per request
    beam_width: int = 0  # beam search: 0 = not a beam-search request


@dataclass(frozen=True)
class LengthProfile:
    """Token lengths drawn from lognormals with these means: sigma near 1 gives the long tail of conversations,
    a small sigma the narrow spread of one-line instructions (see draw_lengths)."""

    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float


# The paper's ShareGPT has mean 161 input / 338 output tokens; outputs are scaled to 125 for 2 CPU cores (the
# reference workload: 200 requests, prompts ~160, outputs ~125). Alpaca keeps the paper's 19 / 58.
SHAREGPT = LengthProfile(input_mean=160, output_mean=125, input_sigma=1.0, output_sigma=0.8)
ALPACA = LengthProfile(input_mean=19, output_mean=58, input_sigma=0.45, output_sigma=0.6)
MIN_LEN, TAIL = 4, 8
RANDOM_LEN = 128  # the random dataset's default input and output length, as `bench throughput` has always had
FILE_OUTPUT_LEN = 128  # output length of a file's requests that give none

# Stdlib modules whose docstrings are the prompts' text: real English that ships with every Python.
CORPUS_MODULES = ("argparse", "calendar", "collections", "csv", "datetime", "decimal", "difflib", "email.message",
                  "fractions", "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging",
                  "os", "pathlib", "random", "shutil", "statistics", "string", "subprocess", "tempfile",
                  "textwrap", "threading", "unittest", "urllib.parse", "zipfile")
FEW_SHOT_TASK = "Name the Python standard library function or class that each description is about.\n\n"
# Alpaca-like instructions about a documented name; the docstring follows as the instruction's input.
INSTRUCTIONS = ("Explain what {name} does.", "Summarize the following description of {name} in one sentence.",
                "Write a short example that uses {name}.", "Rewrite this description of {name} in simpler words.",
                "Give two situations where {name} is useful.", "List the arguments {name} takes.")


def sample_requests(dataset: str, tokenizer, num_prompts: int, seed: int = 0, *, dataset_path: str | None = None,
                    input_len: int | None = None, output_len: int | None = None, max_model_len: int | None = None,
                    n: int = 4, beam_width: int = 4, prefix_len: int = 200,
                    range_ratio: float = 0.0) -> list[BenchRequest]:
    """`num_prompts` requests of a workload, the same for the same seed. `input_len` / `output_len` override the
    dataset's mean lengths (the random dataset: its lengths, spread by `range_ratio`); every request fits in
    `max_model_len` (prompt + output). parallel-sampling and beam-search are Alpaca-like, as the paper's figure 14;
    beam search gives every request the same output length (LLM.beam_search takes one max_tokens for all)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must leave room for a prompt and an output token, got {max_model_len}")
    for name, value in (("input_len", input_len), ("output_len", output_len), ("n", n), ("beam_width", beam_width)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if dataset == "file":
        if not dataset_path:
            raise ValueError("the file dataset needs a dataset path (--dataset-path)")
        return file_requests(tokenizer, dataset_path, num_prompts, seed, output_len, max_model_len)
    if dataset == "random":
        requests = random_requests(tokenizer, num_prompts, input_len or RANDOM_LEN, output_len or RANDOM_LEN,
                                   range_ratio, seed)
    elif dataset == "shared-prefix":
        requests = shared_prefix_requests(tokenizer, num_prompts, prefix_len, output_len or ALPACA.output_mean, seed)
    else:
        profile = SHAREGPT if dataset == "sharegpt" else ALPACA
        profile = dataclasses.replace(profile, input_mean=input_len or profile.input_mean,
                                      output_mean=output_len or profile.output_mean)
        corpus = Corpus(tokenizer, max_prompt_len=max_model_len - 1 if max_model_len else None)
        make = corpus.conversation_requests if dataset == "sharegpt" else corpus.instruction_requests
        requests = make(num_prompts, profile, seed)
        if dataset == "parallel-sampling":
            requests = [dataclasses.replace(r, n=n) for r in requests]
        elif dataset == "beam-search":
            requests = [dataclasses.replace(r, beam_width=beam_width, output_len=round(profile.output_mean))
                        for r in requests]
    return [fit(r, max_model_len, tokenizer) for r in requests]


def fit(request: BenchRequest, max_model_len: int | None, tokenizer) -> BenchRequest:
    """Clip a request to the context: the prompt leaves room for one output token (its text then decoded from the
    clipped ids), the output is cut to the rest."""
    if max_model_len is None:
        return request
    if len(request.prompt_token_ids) >= max_model_len:
        ids = request.prompt_token_ids[:max_model_len - 1]
        request = dataclasses.replace(request, prompt=tokenizer.decode(ids), prompt_token_ids=ids)
    return dataclasses.replace(request, output_len=min(request.output_len,
                                                       max_model_len - len(request.prompt_token_ids)))


def draw_lengths(rng: np.random.Generator, num: int, mean: float, sigma: float) -> list[int]:
    """Lognormal token lengths clipped to [MIN_LEN, TAIL * mean] and rescaled so that their sample mean is `mean`:
    workloads of any size or seed carry the same number of tokens, so their runs compare."""
    lengths = rng.lognormal(0.0, sigma, num)
    for _ in range(3):  # clipping moves the mean a little; a few rounds bring it back
        lengths = np.clip(lengths * (mean / lengths.mean()), MIN_LEN, max(MIN_LEN, TAIL * mean))
    return [int(x) for x in np.rint(lengths)]


# ---- the text corpus --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def stdlib_docstrings() -> tuple[tuple[str, str], ...]:
    """(qualified name, docstring) of the public classes, functions and methods of CORPUS_MODULES, deduplicated,
    in a fixed order."""
    import importlib
    import inspect

    docs: dict[str, str] = {}
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            obj = vars(module)[name]
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            members = [(f"{module_name}.{name}", obj)]
            if inspect.isclass(obj):
                members += [(f"{module_name}.{name}.{m}", v) for m, v in sorted(vars(obj).items())
                            if not m.startswith("_") and inspect.isroutine(v)]
            for qualname, member in members:
                doc = inspect.getdoc(member)
                if doc and len(doc) >= 40:
                    docs.setdefault(doc, qualname)
    return tuple((qualname, doc) for doc, qualname in docs.items())


def summary_line(doc: str) -> str | None:
    """A docstring's first paragraph on one line, if it reads like a sentence of description."""
    line = " ".join(doc.split("\n\n")[0].split())
    return line if 25 <= len(line) <= 160 and line[0].isupper() and line.endswith(".") else None


def ids_from(doc_ids: Sequence[list[int]], start: int, length: int) -> list[int]:
    """Token ids of the documents from `start` on (wrapping around), at least `length` of them if the corpus has."""
    ids: list[int] = []
    for k in range(len(doc_ids)):
        ids += doc_ids[(start + k) % len(doc_ids)]
        if len(ids) >= length:
            break
    return ids


def text_prompts(encode: Callable[[str], list[int]], docs: list[str], num: int, length_range: tuple[int, int],
                 rng: random.Random) -> list[list[int]]:
    """`num` prompts of real text: each starts at a random docstring (continuing into the next ones if short) and
    is cut to a length drawn uniformly from `length_range` tokens."""
    doc_ids = [encode(doc + "\n\n") for doc in docs]
    prompts = []
    for _ in range(num):
        length, start = rng.randint(*length_range), rng.randrange(len(docs))
        prompts.append(ids_from(doc_ids, start, length)[:length])
    return prompts


def few_shot_texts(encode: Callable[[str], list[int]], docs: Sequence[tuple[str, str]], prefix_len: int,
                   num_questions: int, rng: random.Random) -> tuple[list[str], list[str]]:
    """A few-shot prefix of at least `prefix_len` tokens, as its pieces (the task, then description -> name
    examples), and up to `num_questions` distinct questions (a description the examples do not hold)."""
    pairs = [(name, line) for name, doc in docs if (line := summary_line(doc))]
    rng.shuffle(pairs)
    pieces = [FEW_SHOT_TASK]
    tokens = len(encode(FEW_SHOT_TASK))
    while tokens < prefix_len and len(pieces) <= len(pairs):
        name, line = pairs[len(pieces) - 1]
        pieces.append(f"Description: {line}\nFunction: {name}\n\n")
        tokens += len(encode(pieces[-1]))
    used = len(pieces) - 1
    return pieces, [f"Description: {line}\nFunction:" for _, line in pairs[used:used + num_questions]]


def few_shot_workload(encode: Callable[[str], list[int]], docs: Sequence[tuple[str, str]], prefix_len: int,
                      num_questions: int, rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """few_shot_texts as token ids, each piece encoded alone: (prefix, questions)."""
    pieces, questions = few_shot_texts(encode, docs, prefix_len, num_questions, rng)
    return [t for piece in pieces for t in encode(piece)], [encode(q) for q in questions]


@functools.lru_cache(maxsize=2)
def corpus_token_ids(tokenizer) -> tuple[list[int], ...]:
    """Each docstring's token ids (with the blank line that separates it from the next), once per tokenizer."""
    return tuple(tokenizer.encode(doc + "\n\n", add_special_tokens=False) for _, doc in stdlib_docstrings())


class Corpus:
    """The stdlib docstrings tokenized once, to cut prompts of any length from. A prompt is text first: its ids are
    the tokenizer's encoding of that text (special tokens included), exactly what a server would see."""

    def __init__(self, tokenizer, max_prompt_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.docs = stdlib_docstrings()
        self.doc_ids = corpus_token_ids(tokenizer)
        self.num_special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))

    def cut(self, ids: list[int], length: int) -> tuple[str, list[int]]:
        """The text of the first tokens of `ids` whose own encoding has at most `length` tokens (re-encoding a cut
        can merge tokens differently at the seams between documents), with that encoding."""
        for k in range(max(1, length - self.num_special), 1, -1):
            text = self.tokenizer.decode(ids[:k])
            encoded = self.tokenizer.encode(text)
            if len(encoded) <= length:
                return text, encoded
        text = self.tokenizer.decode(ids[:1])
        return text, self.tokenizer.encode(text)

    def conversation_requests(self, num: int, profile: LengthProfile, seed: int) -> list[BenchRequest]:
        """ShareGPT-like: a run of docstring text from a random one on, cut to a drawn length."""
        rng = np.random.default_rng(seed)
        requests = []
        for length, out in zip(*self._lengths(rng, num, profile)):
            start = int(rng.integers(len(self.docs)))
            requests.append(BenchRequest(*self.cut(ids_from(self.doc_ids, start, length), length), out))
        return requests

    def instruction_requests(self, num: int, profile: LengthProfile, seed: int) -> list[BenchRequest]:
        """Alpaca-like: an instruction about a documented name, its docstring as the input, cut to a drawn length."""
        rng = np.random.default_rng(seed)
        requests = []
        for length, out in zip(*self._lengths(rng, num, profile)):
            start = int(rng.integers(len(self.docs)))
            instruction = INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))].format(name=self.docs[start][0])
            head = self.tokenizer.encode(instruction + "\n", add_special_tokens=False)
            requests.append(BenchRequest(*self.cut(head + ids_from(self.doc_ids, start, length), length), out))
        return requests

    def _lengths(self, rng: np.random.Generator, num: int, profile: LengthProfile) -> tuple[list[int], list[int]]:
        inputs = draw_lengths(rng, num, profile.input_mean, profile.input_sigma)
        if self.max_prompt_len is not None:
            inputs = [min(x, self.max_prompt_len) for x in inputs]
        return inputs, draw_lengths(rng, num, profile.output_mean, profile.output_sigma)


# ---- the other workloads ----------------------------------------------------------------------------------------


def synthetic_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                       seed: int) -> list[tuple[list[int], int]]:
    """Random-token prompts (vLLM's 'random' dataset): (prompt token ids, output length) pairs."""
    rng = random.Random(seed)

    def draw(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    # Skip the lowest ids, where special tokens live, so no prompt token is EOS or a control token.
    low = min(1000, vocab_size // 2)
    return [([rng.randrange(low, vocab_size) for _ in range(draw(input_len))], draw(output_len))
            for _ in range(num)]


def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    pairs = synthetic_requests(num, input_len, output_len, range_ratio, tokenizer.vocab_size, seed)
    return [BenchRequest(tokenizer.decode(ids), ids, out) for ids, out in pairs]


def shared_prefix_requests(tokenizer, num: int, prefix_len: int, output_mean: float, seed: int) -> list[BenchRequest]:
    """One few-shot prefix of ~`prefix_len` tokens then a distinct question per request (cycling if `num` exceeds
    the corpus' questions); Alpaca-like output lengths. The prefix text is the same in every prompt, so are the
    token ids of all of it but perhaps its last token (which can merge with the question's first)."""
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be at least 1, got {prefix_len}")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    pieces, questions = few_shot_texts(encode, stdlib_docstrings(), prefix_len, num, random.Random(seed))
    if not questions:
        raise ValueError(f"prefix_len {prefix_len} uses up the corpus: no question is left to ask")
    prefix = "".join(pieces)
    outputs = draw_lengths(np.random.default_rng(seed), num, output_mean, ALPACA.output_sigma)
    prompts = [prefix + questions[i % len(questions)] for i in range(num)]
    return [BenchRequest(p, tokenizer.encode(p), out) for p, out in zip(prompts, outputs)]


# ---- requests from a file ---------------------------------------------------------------------------------------


@dataclass
class FileEntry:
    prompt: str | None  # None when the file gives token ids
    output_len: int | None = None  # given by the file
    reply: str | None = None  # a ShareGPT conversation's first answer: the output length is its token count
    prompt_token_ids: list[int] | None = None  # given by the file (as --save-workload writes them)


def file_requests(tokenizer, path: str, num: int, seed: int, output_len: int | None,
                  max_model_len: int | None) -> list[BenchRequest]:
    """Requests from a JSONL file (or a JSON array, as ShareGPT ships): `{"prompt": ..., "output_len": ...}` (or
    "max_tokens"), `{"prompt_token_ids": [...], "output_len": ...}` (what --save-workload writes) or ShareGPT
    `{"conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}`. The seed shuffles them (a saved workload of
    token ids replays in its own order, as another engine runs it); they cycle if fewer than `num`. Conversations
    without a human turn answered, and prompts longer than the context, are skipped, as vLLM's ShareGPT sampler
    does."""
    entries = [e for e in read_entries(path) if e is not None]
    if not all(e.prompt_token_ids for e in entries):
        random.Random(seed).shuffle(entries)
    requests: list[BenchRequest] = []
    for entry in entries:
        ids = entry.prompt_token_ids or tokenizer.encode(entry.prompt)
        prompt = entry.prompt if entry.prompt is not None else tokenizer.decode(ids)
        out = entry.output_len
        if out is None and entry.reply is not None:
            out = len(tokenizer.encode(entry.reply, add_special_tokens=False))
        out = out or output_len or FILE_OUTPUT_LEN
        if max_model_len is not None and len(ids) >= max_model_len:
            continue
        requests.append(fit(BenchRequest(prompt, ids, out), max_model_len, tokenizer))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path} holds no usable request (a non-empty prompt that fits in max_model_len "
                         f"{max_model_len})")
    return [dataclasses.replace(requests[i % len(requests)]) for i in range(num)]


def read_entries(path: str) -> list[FileEntry | None]:
    """Every entry of the file, checked; None for a conversation that has no answered human turn."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the dataset file {path!r}: {e.strerror}") from e
    if text.lstrip().startswith("["):
        try:
            objects = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from e
        where = "entry"
    else:
        objects = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    objects.append((number, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {number}: not valid JSON: {e}") from e
        where = "line"
    if not objects:
        raise ValueError(f"{path} holds no request")
    return [parse_entry(obj, f"{path}, {where} {number}") for number, obj in objects]


def parse_entry(obj, where: str) -> FileEntry | None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "prompt" in obj or "prompt_token_ids" in obj:
        prompt, ids, out = obj.get("prompt"), obj.get("prompt_token_ids"), obj.get("output_len", obj.get("max_tokens"))
        if ids is not None and (not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ValueError(f'{where}: "prompt_token_ids" must be a non-empty list of token ids')
        if ids is None and (not isinstance(prompt, str) or not prompt):
            raise ValueError(f'{where}: "prompt" must be a non-empty string')
        if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
            raise ValueError(f'{where}: "output_len" / "max_tokens" must be a positive integer, got {out!r}')
        return FileEntry(prompt if ids is None else None, out, prompt_token_ids=ids)
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError(f'{where}: "conversations" must be a list of objects')
        roles = [(t.get("from", t.get("role")), t.get("value", t.get("content"))) for t in turns]
        for i, (role, prompt) in enumerate(roles):
            if role in ("human", "user") and isinstance(prompt, str) and prompt:
                reply = next((v for r, v in roles[i + 1:] if r in ("gpt", "assistant")), None)
                return FileEntry(prompt, reply=reply) if isinstance(reply, str) and reply else None
        return None
    raise ValueError(f'{where}: expected a "prompt", "prompt_token_ids" or "conversations" key')


# ---- arrivals and statistics ------------------------------------------------------------------------------------


def poisson_arrivals(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds from the start: exponential gaps of mean 1/rate; rate=inf -> all zeros.
    The first request arrives at 0, as in vLLM's serving benchmark."""
    if num < 0:
        raise ValueError(f"the number of arrivals must be non-negative, got {num}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (inf: all at once), got {request_rate}")
    if np.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, max(0, num - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:num]


def save_workload(requests: Sequence[BenchRequest], path: str) -> None:
    """The requests as JSONL `{"prompt_token_ids", "output_len"}`: the same workload for another engine (vLLM's
    offline script, `pagedllm bench serve --dataset file`), with no tokenizer in between."""
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}) + "\n")


def describe(requests: Sequence[BenchRequest]) -> dict:
    """Mean, median, 90th percentile and max of the prompt and output lengths, in tokens."""
    def stats(lengths: list[int]) -> dict:
        a = np.asarray(lengths, dtype=float)
        return {"mean": round(float(a.mean()), 1), "median": round(float(np.median(a)), 1),
                "p90": round(float(np.percentile(a, 90)), 1), "max": int(a.max())}

    if not requests:
        raise ValueError("no requests to describe")
    return {"num_requests": len(requests), "input_len": stats([len(r.prompt_token_ids) for r in requests]),
            "output_len": stats([r.output_len for r in requests])}
