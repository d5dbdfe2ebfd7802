"""`pagedllm bench kernels` end to end on the tiny model, in a cache folder of its own: it prints the kernel and
attention tables and the step budget they give, and writes them as JSON. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.entrypoints.cli import main
from pagedllm.model import machine_cache, step_budget
from pagedllm.model.dispatch import KernelTable


def test_bench_kernels_prints_the_tables_and_the_step_budget_they_give(tiny_model_dir, tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setenv(machine_cache.CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--model", tiny_model_dir, "--dtype", "float32", "--threads", "1",
                 "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    assert "routes: " in out and "attention, measured in" in out
    layers = json.loads((Path(tiny_model_dir) / "config.json").read_text())["num_hidden_layers"]
    chosen = step_budget.choose(KernelTable(**result["table"]), layers)
    assert result["step_budget"] == chosen.tokens and chosen.tokens in step_budget.BUDGETS
    assert f"step budget where --max-num-batched-tokens is not given: {chosen.tokens} tokens ({chosen.reason})" in out
