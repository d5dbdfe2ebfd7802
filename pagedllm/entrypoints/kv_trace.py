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
from typing import Any, TextIO

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


def read_trace(path: str) -> tuple[dict[str, Any], list[str]]:
    """A trace's header and its frames (as JSON text, for the player); raises ValueError if it is not a trace."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    try:
        header = json.loads(lines[0]) if lines else {}
    except ValueError:
        header = {}
    if header.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path} is not a pagedllm KV trace (its first line should say format {TRACE_FORMAT!r})")
    return header, lines[1:]
