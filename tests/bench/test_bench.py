"""The benchmarks run end to end on the tiny model: `bench sharing --quick` and a tiny `bench throughput`.
No timing is asserted, only that the runs complete and what block sharing must save."""

from __future__ import annotations

import json

import pytest
from conftest import FAKE_COPY_GBPS, FAKE_GFLOPS

from pagedllm.entrypoints.cli import main

pytestmark = pytest.mark.usefixtures("fake_machine")  # the throughput runs' machine-limit estimates


@pytest.fixture(scope="module")
def sharing_result(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "sharing.json"
    # Block size 4: even the shortest Alpaca-like prompt (10 tokens) fills blocks that samples can share.
    # A 256-token budget: the shared-prefix requests arrive over several steps, so later ones find the prefix cached.
    assert main(["bench", "sharing", "--quick", "--model", tiny_model_dir, "--dtype", "float32", "--block-size", "4",
                 "--num-blocks", "4096", "--max-num-batched-tokens", "256", "--output-json", str(path)]) == 0
    return json.loads(path.read_text())


def test_sharing_json_has_every_table(sharing_result):
    r = sharing_result
    assert r["quick"] and r["block_size"] == 4 and r["num_blocks"] == 4096
    assert {"model", "dtype", "seed", "machine", "loadavg_before", "loadavg_after"} <= r.keys()
    assert [(row["dataset"], row["n"]) for row in r["parallel_sampling"]] == [
        (d, n) for d in ("alpaca", "sharegpt") for n in (2, 4, 6)]
    assert [(row["dataset"], row["width"]) for row in r["beam_search"]] == [
        (d, w) for d in ("alpaca", "sharegpt") for w in (2, 4, 6)]
    assert [row["target_prefix_tokens"] for row in r["shared_prefix"]] == [80, 340]


def test_parallel_sampling_shares_the_prompt(sharing_result):
    for row in sharing_result["parallel_sampling"]:
        shared, unshared = row["shared"], row["unshared"]
        assert row["saved_fraction"] > 0, row
        assert shared["mean_blocks_in_use"] < unshared["mean_blocks_in_use"]
        assert shared["preemptions"] == unshared["preemptions"] == 0
        # Same samples (sample i draws from seed + i in both modes), so the same tokens come out.
        assert shared["output_tokens"] == unshared["output_tokens"] == 2 * row["n"] * 16
        assert shared["prefix_cache_hit_rate"] == unshared["prefix_cache_hit_rate"] == 0


def test_beam_search_shares_through_the_prefix_cache(sharing_result):
    for row in sharing_result["beam_search"]:
        assert row["shared"]["mean_blocks_in_use"] <= row["unshared"]["mean_blocks_in_use"]
        assert row["shared"]["prefix_cache_hit_rate"] > 0 and row["unshared"]["prefix_cache_hit_rate"] == 0
        assert row["shared"]["steps"] == row["unshared"]["steps"] == 6  # one engine step per beam step
    assert all(row["saved_fraction"] > 0 for row in sharing_result["beam_search"] if row["width"] > 2)


def test_shared_prefix_runs_with_the_cache_on_and_off(sharing_result):
    for row in sharing_result["shared_prefix"]:
        assert row["prefix_tokens"] >= row["target_prefix_tokens"] and row["num_requests"] == 8
        for run in (row["cache_on"], row["cache_off"]):
            assert run["output_tokens"] == 8 * 4 and run["requests_per_s"] > 0 and run["preemptions"] == 0
        assert row["cache_on"]["prefix_cache_hit_rate"] > 0.3 and row["cache_off"]["prefix_cache_hit_rate"] == 0
        assert row["speedup"] > 0


def test_throughput_runs(tiny_model_dir, tmp_path, capsys):
    """...and its machine-limit estimate takes this machine's speeds (conftest's fake measurement), saying so."""
    path = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--dtype", "float32", "--num-blocks", "256",
                 "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--output-json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["num_prompts"] == 4 and result["output_tokens"] == 16 and result["num_preemptions"] == 0
    assert 0 <= result["spec_accepted_tokens"] <= result["spec_draft_tokens"]
    bound = result["machine_bound"]
    assert (bound["peak_gflops"], bound["mem_gbps"]) == (FAKE_GFLOPS, FAKE_COPY_GBPS)
    assert bound["source"].startswith("measured here")
    assert f"Machine-limit estimate (100 GFLOP/s matmul, 10 GB/s copy; {bound['source']})" in capsys.readouterr().out


def test_a_machine_bound_too_slow_to_count_is_not_a_ratio(capsys):
    """A matmul peak measured near zero (bf16 emulated where oneDNN cannot run it fast) rounds the bound to 0 tokens/s:
    the report leaves the estimate out instead of dividing by it."""
    import argparse

    from pagedllm.bench.throughput import report_throughput

    lens = {"mean": 8, "median": 8, "p90": 8}
    result = {"workload": {"input_len": lens, "output_len": lens}, "num_prompts": 1, "requests_per_s": 1.0,
              "output_tokens_per_s": 8.0, "total_tokens_per_s": 16.0, "input_tokens": 8, "output_tokens": 8,
              "elapsed_s": 1.0, "machine_bound": {"output_tokens_per_s": 0.0}}
    assert report_throughput(argparse.Namespace(dataset="random", output_json=None), result) == 0
    out = capsys.readouterr().out
    assert "Throughput: 1.00 requests/s, 8.0 output tokens/s" in out and "Machine-limit" not in out


def run_throughput(tiny_model_dir, tmp_path, *flags: str) -> dict:
    path = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--dtype", "float32", "--num-blocks", "512",
                 "--output-json", str(path), *flags]) == 0
    return json.loads(path.read_text())


def test_throughput_on_sharegpt(tiny_model_dir, tmp_path):
    result = run_throughput(tiny_model_dir, tmp_path, "--dataset", "sharegpt", "--num-prompts", "5",
                            "--input-len", "40", "--output-len", "6", "--seed", "3")
    workload = result["workload"]
    assert result["dataset"] == "sharegpt" and result["seed"] == 3 and workload["num_requests"] == 5
    assert result["input_tokens"] == round(workload["input_len"]["mean"] * 5)
    assert result["output_tokens"] == round(workload["output_len"]["mean"] * 5)  # ignore_eos: every token
    assert {"median", "p90", "max"} <= workload["input_len"].keys()
    assert result["num_prompts"] == 5 and result["num_preemptions"] == 0


def test_throughput_with_parallel_samples_and_beams(tiny_model_dir, tmp_path):
    parallel = run_throughput(tiny_model_dir, tmp_path, "--dataset", "parallel-sampling", "--n", "3",
                              "--num-prompts", "2", "--output-len", "5")
    assert parallel["output_tokens"] == 2 * 3 * 5  # every sample counted
    beams = run_throughput(tiny_model_dir, tmp_path, "--dataset", "beam-search", "--beam-width", "2",
                           "--num-prompts", "2", "--output-len", "3")
    assert beams["output_tokens"] == 2 * 2 * 3  # every final beam counted
    assert beams["workload"]["output_len"]["max"] == 3


def test_throughput_samples_as_its_flags_say(tiny_model_dir, tmp_path, monkeypatch):
    from pagedllm.entrypoints.llm import LLM

    seen = []
    generate = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params, **kw: seen.extend(params) or generate(
        self, prompts, params, **kw))
    result = run_throughput(tiny_model_dir, tmp_path, "--num-prompts", "3", "--input-len", "20", "--output-len", "4",
                            "--top-p", "0.9")
    assert result["sampling"] == {"top_p": 0.9, "temperature": 1.0}  # top-p alone samples at temperature 1
    assert [(p.temperature, p.top_p, p.top_k) for p in seen] == [(1.0, 0.9, -1)] * 3
    assert result["output_tokens"] == 3 * 4
    seen.clear()
    result = run_throughput(tiny_model_dir, tmp_path, "--num-prompts", "2", "--input-len", "20", "--output-len", "4",
                            "--temperature", "0.7", "--top-k", "5")
    assert [(p.temperature, p.top_p, p.top_k) for p in seen] == [(0.7, 1.0, 5)] * 2
    seen.clear()
    assert run_throughput(tiny_model_dir, tmp_path, "--num-prompts", "2", "--input-len", "20",
                          "--output-len", "4")["sampling"] == {}
    assert all(p.greedy for p in seen)


def test_throughput_rejects_a_bad_dataset_file(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--num-blocks", "64", "--dataset", "file",
                 "--dataset-path", str(bad)]) == 2
    assert "line 1: not valid JSON" in capsys.readouterr().err


def test_throughput_breakdown_accounts_for_every_step_and_second(tiny_model_dir, tmp_path, capsys):
    """--breakdown: the parts (the step timers' plus "other") add up to the run's wall time, the size classes hold every
    step and every row the scheduler ran (a prompt-sized class and a decode-sized one here), and both tables print."""
    result = run_throughput(tiny_model_dir, tmp_path, "--num-prompts", "4", "--input-len", "40", "--output-len", "6",
                            "--max-num-batched-tokens", "64", "--num-speculative-tokens", "0", "--breakdown")
    b = result["breakdown"]
    parts = b["parts_s"]
    assert abs(sum(parts.values()) - b["elapsed_s"]) < 0.01 and parts["linear"] > 0 and parts["attention"] > 0
    classes = {c["rows_up_to"]: c for c in b["by_rows"]}
    assert all(c["rows"] <= c["rows_up_to"] * c["steps"] and c["rows"] > c["rows_up_to"] // 2 * c["steps"]
               for c in classes.values())
    # 160 prompt tokens in steps of at most 64 rows, then 5 decode steps of 4 rows (the first token: with the prompt)
    assert sum(c["rows"] for c in classes.values()) == 4 * 40 + 4 * 5
    assert max(classes) == 64 and 4 in classes and sum(c["steps"] for c in classes.values()) >= 3 + 5
    assert sum(c["seconds"] for c in classes.values()) <= b["elapsed_s"] + 0.01
    out = capsys.readouterr().out
    assert "Where the time went" in out and "| rows a step computed, up to |" in out
    assert main(["bench", "throughput", "--model", tiny_model_dir, "--backend", "hf", "--breakdown"]) != 0
    assert "does not apply to --backend hf" in capsys.readouterr().err
