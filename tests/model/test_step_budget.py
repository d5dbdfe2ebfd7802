"""The step budget chosen where the engine runs (model/step_budget.py), from fake kernel tables: the largest budget
whose matmuls fit the cap, never below the first; the flag always wins; the engine logs and runs what was chosen; a
scheduler made without the engine takes the first."""

from __future__ import annotations

import logging

import pytest

from pagedllm.config import FIRST_STEP_BUDGET, EngineConfig, SchedulerConfig, fixed_step_budget
from pagedllm.core.baselines import make_scheduler
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model import step_budget
from pagedllm.model.dispatch import KernelTable
from pagedllm.model.step_budget import BUDGETS, LAYER_KINDS, STEP_MATMUL_S, StepBudget, choose

ROWS = [1, 64, FIRST_STEP_BUDGET]


def table_with(layer_s: float, untimed: str | None = None) -> KernelTable:
    """A table whose layer matmuls at the first budget's rows sum to `layer_s` (the fastest path of each kind: a slower
    one beside it must not count); `untimed`: a kind with no timing there."""
    times = {}
    for kind in LAYER_KINDS:
        fast = None if kind == untimed else layer_s / len(LAYER_KINDS)
        times[kind] = {"onednn": [1e-5, 1e-4, fast], "int4": [1e-6, 1e-4, None if fast is None else fast * 3]}
    return KernelTable(buckets={kind: list(ROWS) for kind in LAYER_KINDS}, times=times)


@pytest.mark.parametrize("step_s,expected", [
    (STEP_MATMUL_S / 8, 4096),  # 4,096 tokens take half the cap
    (STEP_MATMUL_S * 0.99 / 4, 4096),  # just within the cap at 4,096
    (STEP_MATMUL_S * 1.01 / 4, 2048),
    (STEP_MATMUL_S / 3, 2048),
    (STEP_MATMUL_S / 2, 2048),
    (STEP_MATMUL_S * 0.9, 1024),
    (STEP_MATMUL_S * 3, 1024),  # slower than the cap already: the first budget, not less
])
def test_the_largest_budget_whose_matmuls_fit_the_cap(step_s, expected):
    layers = 30
    chosen = choose(table_with(step_s / layers), layers)
    assert chosen.tokens == expected
    assert f"{step_s * 1e3:.0f} ms" in chosen.reason


def test_the_first_budget_without_a_table_or_a_timing_at_its_rows():
    assert choose(None, 30).tokens == FIRST_STEP_BUDGET
    assert choose(table_with(1e-6, untimed="down"), 30).tokens == FIRST_STEP_BUDGET
    short = table_with(1e-6)
    short.buckets = {kind: [1, 64, 512] for kind in LAYER_KINDS}  # no row count of the first budget
    assert choose(short, 30).tokens == FIRST_STEP_BUDGET
    assert BUDGETS[0] == FIRST_STEP_BUDGET


def test_fixed_budget_for_what_runs_without_the_engine():
    assert fixed_step_budget(None) == FIRST_STEP_BUDGET
    assert fixed_step_budget(64) == 64
    assert fixed_step_budget(None, 5000) == 5000 and fixed_step_budget(64, 100) == 100
    assert make_scheduler(SchedulerConfig(), 64).max_num_batched_tokens == FIRST_STEP_BUDGET


def test_the_engine_runs_the_chosen_budget_and_the_flag_over_it(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(step_budget, "choose", lambda table, layers: StepBudget(2048, "fake"))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        chosen = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=64))
    assert chosen.max_num_batched_tokens == chosen.scheduler.max_num_batched_tokens == 2048
    assert "step budget 2048 tokens (--max-num-batched-tokens): fake" in caplog.text
    flagged = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=64, max_num_batched_tokens=96))
    assert flagged.max_num_batched_tokens == 96


def test_the_runner_passes_its_kernel_table_and_layers(tiny_model_dir, monkeypatch):
    seen = []
    monkeypatch.setattr(step_budget, "choose", lambda table, layers: seen.append((table, layers)) or
                        StepBudget(FIRST_STEP_BUDGET, "fake"))
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", num_blocks=64))
    assert seen == [(engine.runner.model.kernel_table, engine.model_config.num_hidden_layers)]
