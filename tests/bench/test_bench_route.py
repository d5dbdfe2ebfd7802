"""`pagedllm bench route`: the simulation runs every request through the real router and schedulers, prefix
affinity finds more of the engines' caches on chats than round-robin, and the command writes its JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.bench.route import DEFAULT_COST, CostModel, make_workload, simulate
from pagedllm.entrypoints.cli import main

REPO = Path(__file__).resolve().parents[2]
SIM = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=2048,
           margin=8, seed=0)


def test_the_default_cost_model_is_the_fit_of_the_shipped_latency_run():
    fitted = CostModel.fit(json.loads((REPO / "docs/results/latency_after.json").read_text()), "docs")
    for name in ("fixed_ms", "token_ms", "decode_context_ms", "prefill_pair_ms"):
        assert getattr(fitted, name) == pytest.approx(getattr(DEFAULT_COST, name), rel=0.02)


@pytest.fixture(scope="module")
def chats():
    return make_workload("chats", 48, 4.0, 0, num_system_prompts=4, system_len=256, turns=4, think_time=1.0,
                         max_prompt_len=2048)


def test_every_request_completes_and_affinity_finds_more_cache(chats):
    results = {p: simulate(chats, p, 4, DEFAULT_COST, **SIM) for p in ("prefix-affinity", "round-robin")}
    for r in results.values():
        assert r.num_requests == chats.num_requests and r.throughput_tok_s > 0
    assert results["prefix-affinity"].prefix_hit_rate > results["round-robin"].prefix_hit_rate + 0.2
    assert results["prefix-affinity"].ttft_p50_s < results["round-robin"].ttft_p50_s


def test_a_chat_turn_holds_the_previous_turn_and_its_answer(chats):
    first = chats.first[0]
    second = chats.follow_ups[first.conversation][0]
    assert second.prompt[:len(first.prompt) + len(first.output)] == first.prompt + first.output


def test_the_command_writes_json_and_plot(tmp_path: Path):
    out, plot = tmp_path / "route.json", tmp_path / "route.png"
    assert main(["bench", "route", "--num-replicas", "2,4", "--requests-per-replica", "6", "--system-len", "128",
                 "--workloads", "system-prompts,chats", "--output-json", str(out), "--plot", str(plot)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 2 * 2 * 3 and plot.stat().st_size > 0
