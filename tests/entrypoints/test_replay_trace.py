"""`pagedllm replay` plays only traces it has checked: the page renders a trace's strings and sizes its arrays by
its numbers, so a crafted or truncated file is refused with a message naming the line, never rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.kv_trace import TRACE_FORMAT, read_trace

HEADER = {"format": TRACE_FORMAT, "model": "tiny", "every": 2}


def frame(**changes: object) -> dict:
    base = {"version": 1, "full": True, "step": 3, "time": 1.5, "num_blocks": 8, "block_size": 4,
            "kv_policy": "paged", "blocks": [0, 1, 1, 5, 2, 2],
            "requests": [{"request_id": "r1", "status": "running", "prompt_tokens": 5, "n": 1, "prompt": "hi",
                          "samples": [{"seq_id": 1, "index": 0, "status": "running", "num_tokens": 6,
                                       "tokens_stored": 5, "slots_held": 8, "output_tokens": 1, "preemptions": 0,
                                       "block_table": [0, 5]}]}],
            "counters": {"num_blocks": 8, "blocks_in_use": 2}, "events": [
                {"index": 0, "step": 3, "kind": "prefix_hit", "seq_id": 1, "request_id": "r1", "blocks": [5],
                 "tokens": 4}], "events_dropped": 0}
    base.update(changes)
    return base


def write(tmp_path: Path, *lines: object, raw_tail: str = "") -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + raw_tail)
    return str(path)


def test_a_well_formed_trace_is_read(tmp_path: Path) -> None:
    header, frames = read_trace(write(tmp_path, HEADER, frame(), frame(full=False)))
    assert header["model"] == "tiny" and header["every"] == 2 and len(frames) == 2


def test_a_script_in_a_status_is_refused(tmp_path: Path) -> None:
    bad = frame()
    bad["requests"][0]["status"] = '<img src=x onerror="document.body.innerHTML=1">'
    with pytest.raises(ValueError, match=r"line 2: requests\.0\.status"):
        read_trace(write(tmp_path, HEADER, bad))


@pytest.mark.parametrize("num_blocks", [2e9, 2_000_000_000, 0, "8"])
def test_a_pool_size_the_page_cannot_hold_is_refused(tmp_path: Path, num_blocks: object) -> None:
    with pytest.raises(ValueError, match="line 2: num_blocks"):
        read_trace(write(tmp_path, HEADER, frame(num_blocks=num_blocks)))


def test_a_block_outside_the_pool_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not below num_blocks"):
        read_trace(write(tmp_path, HEADER, frame(blocks=[9, 1, 1])))


def test_a_truncated_trace_is_refused_with_a_hint(tmp_path: Path) -> None:
    whole = json.dumps(frame())
    with pytest.raises(ValueError, match="line 3: .*cut short"):
        read_trace(write(tmp_path, HEADER, frame(), raw_tail=whole[: len(whole) // 2]))


@pytest.mark.parametrize("first", ["[1,2]", "{}", "not json", ""])
def test_a_file_that_is_not_a_trace_is_refused(tmp_path: Path, first: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(first + "\n" + json.dumps(frame()) + "\n")
    with pytest.raises(ValueError, match="not a pagedllm KV trace"):
        read_trace(str(path))


def test_the_replay_command_says_why_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, [1, 2])
    assert main(["replay", path, "--port", "1"]) == 2
    assert "not a pagedllm KV trace" in capsys.readouterr().err
