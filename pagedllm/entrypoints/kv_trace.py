"""The engine's KV snapshots as JSON frames: the dashboard's event stream, and the trace files that
`pagedllm bench throughput --trace` writes and `pagedllm replay` plays back.

A trace is JSONL: a header line {"format": TRACE_FORMAT, ...run facts}, then one frame per line, a frame being an
`LLMEngine.kv_snapshot` as JSON (docs/dashboard.md lists its fields). The first frame and every `keyframe_every`-th
are full; the others are diffs, so a player seeks from the nearest full frame.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TRACE_FORMAT = "pagedllm-kv-trace/1"


def plain(obj: Any) -> Any:
    """JSON for a dataclass, one level at a time (json.dumps calls it again for nested ones); tuples are lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def to_json(obj: Any) -> str:
    return json.dumps(obj, default=plain, separators=(",", ":"), ensure_ascii=False)


def frame_of(snapshot: Any, **extra: Any) -> dict[str, Any]:
    """A snapshot as a frame: its fields, and `extra` ones on top."""
    return {**plain(snapshot), **extra}


def history_point(snapshot: Any) -> list[float]:
    """What the dashboard's time series plot, for one snapshot: [time, blocks in use, blocks cached-free, running,
    waiting, generated tokens, prefix-cache hits, prefix-cache queries, preemptions]."""
    c = snapshot.counters
    return [round(snapshot.time, 3), c.blocks_in_use, c.blocks_cached_free, c.num_running, c.num_waiting,
            c.generated_tokens, c.prefix_cache_hits, c.prefix_cache_queries, c.preemptions]


class TraceRecorder:
    """A step observer writing the engine's KV snapshots to a trace: one every `every` steps (a diff, but for a
    full keyframe every `keyframe_every` frames), and one more at `close()`, so the file stays small."""

    def __init__(self, engine: Any, path: str, every: int = 8, keyframe_every: int = 50,
                 **facts: Any) -> None:
        if every < 1:
            raise ValueError(f"--trace-every must be positive, got {every}")
        self.engine, self.every, self.keyframe_every = engine, every, keyframe_every
        self.steps = self.frames = 0
        self.version: int | None = None
        self.file: TextIO = open(path, "w")  # closed by close()
        header = {"format": TRACE_FORMAT, "created": time.time(), "model": engine.model_name, "every": every,
                  **facts}
        self.file.write(to_json(header) + "\n")

    def __call__(self, record: Any) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.write()

    def write(self) -> None:
        since = None if self.frames % self.keyframe_every == 0 else self.version
        snap = self.engine.kv_snapshot(since)
        self.version = snap.version
        self.frames += 1
        self.file.write(to_json(frame_of(snap)) + "\n")

    def close(self) -> None:
        if not self.file.closed:
            self.write()
            self.file.close()


MAX_TRACE_BLOCKS = 1 << 22  # a pool larger than any this engine builds; the page allocates one cell per block
Count = Annotated[int, Field(strict=True, ge=0)]
Name = Annotated[str, Field(max_length=4096)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TraceHeader(_Strict):
    format: Literal["pagedllm-kv-trace/1"]
    model: Name | None = None


class TraceSample(_Strict):
    index: Count
    status: Literal["waiting", "running", "finished"]
    tokens_stored: Count
    slots_held: Count
    output_tokens: Count
    block_table: list[Count]


class TraceRequest(_Strict):
    request_id: Name
    status: Literal["waiting", "running", "preempted", "finished"]
    prompt_tokens: Count
    n: Count
    prompt: Name = ""
    samples: list[TraceSample]


class TraceEvent(_Strict):
    index: Count
    step: Count
    kind: Literal["cow", "fork", "preempt", "prefix_hit", "evict", "reset", "restore"]
    request_id: Name | None = None
    blocks: list[Count]
    tokens: Count = 0


class TraceFrame(_Strict):
    """What the replay page reads of a frame, with the types and ranges it may trust (it renders them as HTML)."""

    full: bool
    step: Count
    time: float = Field(allow_inf_nan=False)
    num_blocks: Annotated[int, Field(strict=True, ge=1, le=MAX_TRACE_BLOCKS)]
    block_size: Annotated[int, Field(strict=True, ge=1)]
    kv_policy: Annotated[str, Field(pattern=r"^[a-z0-9-]{1,32}$")]
    blocks: list[Count]
    requests: list[TraceRequest]
    counters: dict[str, Count]
    events: list[TraceEvent]

    @model_validator(mode="after")
    def blocks_in_the_pool(self) -> TraceFrame:
        if len(self.blocks) % 3:
            raise ValueError("blocks must be (block id, state, ref count) triples")
        if any(b >= self.num_blocks for b in self.blocks[0::3]) or any(s > 6 for s in self.blocks[1::3]):
            raise ValueError(f"a block id is not below num_blocks ({self.num_blocks}) or a state is not 0-6")
        return self


def read_trace(path: str) -> tuple[dict[str, Any], list[str]]:
    """A trace's header and its frames (as JSON text, for the player). Raises ValueError naming the first line that
    is not what `bench throughput --trace` writes: the page renders a trace's strings, so it gets only checked ones."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f.read().splitlines(), 1) if line.strip()]
    if not lines or not _is_header(lines[0][1]):
        raise ValueError(f"{path} is not a pagedllm KV trace (its first line should say format {TRACE_FORMAT!r})")
    header = _checked(TraceHeader, path, *lines[0])
    for n, line in lines[1:]:
        _checked(TraceFrame, path, n, line)
    return header, [line for _, line in lines[1:]]


def _is_header(line: str) -> bool:
    try:
        first = json.loads(line)
    except ValueError:
        return False
    return isinstance(first, dict) and first.get("format") == TRACE_FORMAT


def _checked(model: type[BaseModel], path: str, number: int, line: str) -> dict[str, Any]:
    try:
        return model.model_validate_json(line).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the line"
        hint = " (the trace looks cut short: was its run stopped while writing?)" if first["type"] == "json_invalid" \
            else ""
        raise ValueError(f"{path}, line {number}: {where}: {first['msg']}{hint}; not replayed") from None
