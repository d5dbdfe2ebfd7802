"""SchedulerConfig as EngineConfig's scheduler share, make_scheduler from it, and the part timer's accounting (plain
Python: no model)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

import pagedllm
from pagedllm.config import EngineConfig, SchedulerConfig
from pagedllm.core.baselines import ReservingScheduler, StaticBatching, make_scheduler
from pagedllm.core.scheduler import Scheduler
from pagedllm.model import timing
from pagedllm.model.timing import NO_TIMER, PartTimer


def test_engine_config_composes_the_scheduler_config_from_its_flat_fields():
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=40, block_size=8, num_speculative_tokens=2,
                          speculative_disable_by_batch_size=5, batching="static")
    assert config.scheduler_config == SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=40, block_size=8,
                                                      num_speculative_tokens=2, speculative_disable_by_batch_size=5,
                                                      batching="static")
    defaults = EngineConfig()
    assert all(getattr(defaults, f.name) == f.default for f in dataclasses.fields(SchedulerConfig))
    config.max_num_seqs = 7  # read anew
    assert config.scheduler_config.max_num_seqs == 7


def test_a_reservation_policy_turns_prefix_caching_off_in_both():
    assert not SchedulerConfig(kv_policy="reserve-max").enable_prefix_caching
    config = EngineConfig(kv_policy="reserve-pow2")
    assert not config.enable_prefix_caching and not config.scheduler_config.enable_prefix_caching


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("block_size", 0),
                                         ("kv_policy", "lru"), ("batching", "dynamic"),
                                         ("num_speculative_tokens", -1), ("speculative_disable_by_batch_size", 0)])
def test_scheduler_fields_are_checked_through_either_config(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})
    with pytest.raises(ValueError):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("kv_policy,batching,cls,speculates", [
    ("paged", "continuous", Scheduler, True), ("paged", "static", StaticBatching, False),
    ("reserve-max", "continuous", ReservingScheduler, False)])
def test_make_scheduler_sets_speculation_only_where_tables_grow(kv_policy, batching, cls, speculates):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48, block_size=4,
                             kv_policy=kv_policy, batching=batching, num_speculative_tokens=3,
                             speculative_disable_by_batch_size=2)
    sched = make_scheduler(config, num_blocks=32)
    assert type(sched) is cls and sched.block_manager.block_size == 4 and sched.block_manager.num_total_blocks == 32
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len) == (4, 64, 48)
    assert sched.num_speculative_tokens == (3 if speculates else 0)
    if speculates:
        assert sched.gate.limit == 2
    assert sched.block_manager.enable_prefix_caching == (kv_policy == "paged")


def test_part_timer_counts_inner_parts_apart_except_inside_an_opaque_one(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    timer = PartTimer(("outer", "inner", "logits"))
    inner = timer.timed("inner", lambda: None)
    with timer.part("outer"):  # 0 .. 3, inner 1 .. 2
        inner()
    with timer.part("logits", opaque=True):  # 4 .. 5: inner runs but is not counted
        inner()
    assert timer.seconds == {"outer": 2, "inner": 1, "logits": 1}
    assert timer.calls == {"outer": 1, "inner": 1, "logits": 1}


def test_no_timer_wraps_nothing():
    fn = len
    assert NO_TIMER.timed("linear", fn) is fn
    with NO_TIMER.part("schedule"):
        pass
    assert NO_TIMER.seconds == {} and NO_TIMER.calls == {}


def test_no_module_replaces_another_modules_names_at_run_time():
    """The timers used to patch llama's functions process-wide; now nothing in the package calls setattr / delattr
    or assigns to a name of a module it imported."""
    offenders = []
    for path in sorted(Path(pagedllm.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr",
                                                                                                    "delattr"):
                offenders.append(f"{path.name}:{node.lineno}")
            targets = node.targets if isinstance(node, ast.Assign) else []
            offenders += [f"{path.name}:{node.lineno}" for t in targets if isinstance(t, ast.Attribute)
                          and isinstance(t.value, ast.Name) and t.value.id in modules]
    assert not offenders
