"""`pagedllm bench sessions`: its workload and plan without a server, and a short whole run against `pagedllm serve`
processes on the tiny model (structure and the server's prefix-cache counters only, never a timing)."""

from __future__ import annotations

import json

from pagedllm.bench.sessions import Session, Workload, make_sessions, plan_runs, pool_blocks
from pagedllm.entrypoints.cli import main
from pagedllm.model.loader import load_tokenizer


def test_a_turn_resends_the_whole_conversation():
    s = Session("agent0", "agent", "tools", ["task", "result 1", "result 2"])
    assert s.messages(0, []) == [{"role": "system", "content": "tools"}, {"role": "user", "content": "task"}]
    assert [m["role"] for m in s.messages(2, ["a", "b"])] == ["system", "user", "assistant", "user", "assistant",
                                                               "user"]
    assert s.messages(2, ["a", "b"])[-2:] == [{"role": "assistant", "content": "b"},
                                              {"role": "user", "content": "result 2"}]


def test_sessions_are_seeded_and_sized_by_the_tokenizer(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    w = Workload(chat_sessions=2, chat_turns=2, chat_first_len=40, chat_user_len=10, agent_sessions=1,
                 agent_steps=2, agent_system_len=120, agent_tool_len=20)
    sessions = make_sessions(tokenizer, w)
    assert [s.name for s in sessions] == ["chat0", "chat1", "agent0"]
    assert sessions == make_sessions(tokenizer, w)  # deterministic
    assert sessions[0].users != sessions[1].users
    n = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert abs(n(sessions[0].users[0]) - 40) <= 2 and abs(n(sessions[2].system) - 120) <= 2
    assert abs(n(sessions[2].users[1]) - 20) <= 2 and '"name"' in sessions[2].system


def test_pool_and_plan():
    assert pool_blocks([100, 300], 0.5, 16) == 39  # two of the longest and a block: more than half of all
    assert pool_blocks([100] * 20, 0.5, 16) == 63
    runs, skipped = plan_runs(["no-cache", "ram", "ram+tier", "restart"], ["fcfs", "lpm"], has_tier=False)
    assert runs == [("fcfs", "no-cache"), ("fcfs", "ram"), ("lpm", "ram")]
    assert "--kv-offload-dir" in skipped["restart/lpm"] and "first policy" in skipped["no-cache/lpm"]
    runs, skipped = plan_runs(["ram", "restart"], ["fcfs"], has_tier=True)
    assert runs == [("fcfs", "ram")] and "add ram+tier" in skipped["restart/fcfs"]


def test_bench_sessions_returning_turns_hit_the_prefix_cache(tiny_model_dir, tmp_path):
    out = tmp_path / "sessions.json"
    assert main(["bench", "sessions", "--model", tiny_model_dir, "--dtype", "float32", "--threads", "1",
                 "--attention-backend", "reference", "--num-blocks", "256", "--chat-sessions", "2", "--chat-turns",
                 "2", "--chat-first-len", "40", "--chat-user-len", "8", "--agent-sessions", "1", "--agent-steps", "2",
                 "--agent-system-len", "100", "--agent-tool-len", "16", "--output-len", "4", "--think-time", "0.1",
                 "--server-log-dir", str(tmp_path), "--output-json", str(out), "--plot",
                 str(tmp_path / "sessions.png")]) == 0
    result = json.loads(out.read_text())
    runs = {r["config"]: r for r in result["runs"]}
    assert result["num_blocks"] == 256 and "--scheduling-policy" not in result["server_argv"]
    assert (tmp_path / "sessions.png").stat().st_size > 0
    assert set(runs) == {"no-cache", "ram", "ram+tier", "restart"} and not result["skipped"]
    assert runs["restart"]["turns"] == 3  # the returning turns, replayed
    for config, run in runs.items():
        assert run["failed"] == 0 and all(t["output_tokens"] == 4 for t in run["turn_log"])
        if config != "restart":
            assert run["turns"] == 6 and sorted(t["turn"] for t in run["turn_log"]) == [0, 0, 0, 1, 1, 1]
    assert runs["no-cache"]["prefix_cache_hits"] == 0
    assert runs["no-cache"]["computed_prompt_tokens"] == runs["no-cache"]["prompt_tokens"] > 0
    ram = runs["ram"]
    prompts = {(t["session"], t["turn"]): t["prompt_tokens"] for t in ram["turn_log"]}
    # each returning turn finds at least the full blocks of the turn before it (all but the block at the seam)
    expected = sum(((prompts[s, 0] - 1) // 16 - 1) * 16 for s in ("chat0", "chat1", "agent0"))
    assert expected > 0 and ram["prefix_cache_hits"] >= expected
    assert ram["computed_prompt_tokens"] <= ram["prompt_tokens"] - expected  # nothing preempted in a pool this big
    assert ram["first_p50_ttft_s"] is not None and ram["returning_p50_ttft_s"] is not None
    # after the restart the pool is empty: each replayed turn's prefix comes back from the second tier
    restart = runs["restart"]
    assert restart["restored_prompt_tokens"] >= expected and restart["tier"]["pagedllm:kv_tier_hits_total"] > 0
    assert restart["computed_prompt_tokens"] <= restart["prompt_tokens"] - expected
