"""A build makes only the forms its cached kernel table's routes take (dispatch.planned_forms), so a later start
spends no time or memory on forms it would drop; a build whose table turns out to be for other shapes measures what it
made and caches nothing. The routes come from fake timings (no timing assertions)."""

from __future__ import annotations

import functools
import json
import logging
import math

import pytest
import torch
from conftest import write_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.model import bf16_choice, dispatch, kernel_timing, kernels, machine_cache
from pagedllm.model.loader import Q4Weight
from pagedllm.model.model_runner import kernel_variant

# the 4-bit kernel wins every row count it can take (its fp16 products and int8 activations, where they run, second),
# then int8, then oneDNN: a weight with a 4-bit form routes all its rows there, the lm_head (plain in the file) to int8
PER_ROW = {"int4": 1.0, "int4_f16": 1.5, "int4_q8": 1.6, "int8": 2.0, "int8_mm": 3.0, "bf16_gemm": 4.0,
           "bf16_plain": 6.0, "onednn": 5.0}


def fake_timer(kind: str, path: str, rows: int, run) -> float:
    return PER_ROW[path.removesuffix("_cold")] * rows


@pytest.fixture(autouse=True)
def fake_machine(tmp_path, monkeypatch):
    """Its own cache folder, nothing forced, an idle machine, fp32 by `--dtype auto` (the lm_head may go int8), and
    the fake timings."""
    ext = kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")
    if not (ext.int4_linear_f32_supported() and kernels.int8_available()):
        pytest.skip("no fp32 4-bit kernel or no exact int8 product here: nothing to route away from oneDNN")
    monkeypatch.setenv(machine_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    monkeypatch.setattr(machine_cache, "machine_load", lambda: 0.0)
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 0.0)
    monkeypatch.setattr(machine_cache, "_unsaved", {})
    monkeypatch.setattr(kernel_timing, "BUDGET_S", math.inf)
    monkeypatch.setattr(bf16_choice, "bf16_pays", lambda: False)
    monkeypatch.setattr(dispatch, "tune", functools.partial(dispatch.tune, timer=fake_timer))


@pytest.fixture(scope="module")
def q4_gguf(tiny_model_dir, tmp_path_factory) -> str:
    return write_gguf(tiny_model_dir, str(tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf"), quant="Q4_1")


def engine(path: str) -> LLM:
    return LLM(model=path, kv_cache_memory="16MiB", threads=1)


def forms(llm: LLM) -> dict[str, list[tuple[frozenset[str], frozenset[str]]]]:
    """Each weight's forms made and skipped, by kind."""
    return {kind: [(w.paths(), w.skipped) for w in ws] for kind, ws in llm.engine.runner.model.packed_weights().items()}


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ([1, 2000, 3000], list(range(100, 140)))], params,
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_later_start_makes_only_the_routed_forms(q4_gguf, monkeypatch):
    dense = []  # the 4-bit weights whose dense rows were made (for the forms that read them)
    values = Q4Weight.values
    monkeypatch.setattr(Q4Weight, "values", lambda self: dense.append(self.q.shape) or values(self))
    first = engine(q4_gguf)  # measures: every form made, the unrouted ones dropped after
    assert len(dense) == 2 * 7  # each projection of both layers
    made = forms(first)
    assert made["qkv"][0] == (frozenset({"int4"}), frozenset())
    assert made["lm_head"][0] == (frozenset({"int8"}), frozenset())
    dense.clear()
    second = engine(q4_gguf)  # reads the table before its build
    assert dense == []  # the 4-bit kernel alone takes every layer matmul: no dense rows made
    again = forms(second)
    model = second.engine.runner.model
    qkv_forms = model.possible_forms(model.layers[0].qkv_weight.shape, "qkv", True)  # onednn, int4 (+ int4_f16)
    assert again["qkv"][0] == (frozenset({"int4"}), qkv_forms - {"int4"}) and "onednn" in qkv_forms
    lm_head_forms = model.possible_forms(model.lm_head_weight.shape, "lm_head", False)  # onednn, int8, int8_mm if exact
    assert again["lm_head"][0] == (frozenset({"int8"}), lm_head_forms - {"int8"}) and "onednn" in lm_head_forms
    assert {kind: [m for m, _ in ws] for kind, ws in again.items()} == {kind: [m for m, _ in ws] for kind, ws in
                                                                          made.items()}
    assert greedy(second) == greedy(first)


def test_a_later_start_keeps_the_fp16_form_its_routes_take(q4_gguf, monkeypatch):
    """Where the 4-bit weights' fp16 products win (AVX512-FP16, `--dtype auto` on fp32), a later start builds that
    form alone (no route takes the exact kernel's) and runs it (where they lose, the test above: the later start's
    weights have the exact kernel's form alone)."""
    from pagedllm.model.weight_forms import Int4Weight
    if not Int4Weight.f16_available(torch.float32, kernels.load()):
        pytest.skip("no fp16 4-bit kernel on this CPU (it needs AVX512-FP16)")
    monkeypatch.setitem(PER_ROW, "int4_f16", 0.5)
    first = engine(q4_gguf)
    assert forms(first)["qkv"][0] == (frozenset({"int4_f16"}), frozenset())
    second = engine(q4_gguf)
    model = second.engine.runner.model
    # onednn, int4 (+ int4_q8: VNNI or AVX2)
    qkv_forms = model.possible_forms(model.layers[0].qkv_weight.shape, "qkv", True)
    assert {"onednn", "int4"} <= qkv_forms
    assert forms(second)["qkv"][0] == (frozenset({"int4_f16"}), qkv_forms - {"int4_f16"})
    assert {w.path_for(64) for w in second.engine.runner.model.packed_weights()["gate_up"]} == {"int4_f16"}
    assert greedy(second) == greedy(first)


def test_each_weight_would_have_the_forms_predicted_for_it(q4_gguf, monkeypatch):
    """possible_forms names exactly what a build without a plan makes: the table's key is the same either way."""
    monkeypatch.setenv(dispatch.FORCE_ENV, "static")  # no plan, and every form kept
    model = engine(q4_gguf).engine.runner.model
    for kind, ws in model.packed_weights().items():
        for w in ws:
            assert w.paths() == model.possible_forms(w.shape, kind, w.int4 is not None) and not w.skipped


def test_a_table_for_other_shapes_plans_nothing(q4_gguf, caplog):
    """A table cached for another model of the same file name and flags (its o_proj another shape): the build makes
    every form, the engine measures and caches its own table."""
    engine(q4_gguf)
    (file,) = machine_cache.cache_file({}).parent.glob("kernels-*.json")
    cached = json.loads(file.read_text())
    shapes = json.loads(cached["key"]["shapes"])
    shapes["o"] = shapes["o"].replace("64x", "96x")
    cached["key"]["shapes"] = json.dumps(shapes, sort_keys=True)
    file.write_text(json.dumps(cached))
    caplog.set_level(logging.INFO, logger="pagedllm")
    llm = engine(q4_gguf)
    assert all(not skipped for ws in forms(llm).values() for _, skipped in ws)
    assert "measured in" in caplog.text and json.loads(file.read_text())["key"]["shapes"] != cached["key"]["shapes"]


def test_a_table_replaced_after_the_plan_is_read_as_planned_or_refused(q4_gguf, caplog):
    """Between the plan and the tuning another process may rewrite the table (its shapes differ): the table on disk
    is read regardless of its shapes where its routes take only forms the build made; else, or with no table at all,
    the engine cannot measure forms it never made, and says so."""
    first = engine(q4_gguf)
    weights = first.engine.runner.model.packed_weights()
    for w in (w for ws in weights.values() for w in ws):
        w.skipped = frozenset({"onednn"})  # as a planned build leaves them
    (file,) = machine_cache.cache_file({}).parent.glob("kernels-*.json")
    cached = json.loads(file.read_text())
    cached["key"]["shapes"] = json.dumps({kind: "1x1:onednn" for kind in weights})
    file.write_text(json.dumps(cached))
    caplog.set_level(logging.INFO, logger="pagedllm")
    tune = functools.partial(dispatch.tune, weights, first.engine.runner.model.dtype, first.engine.model_name,
                             variant=kernel_variant(first.engine.config))
    table = tune()
    assert table is not None and "as the build planned" in caplog.text
    cached["times"]["qkv"]["onednn"] = [t and t / 100 for t in cached["times"]["qkv"]["onednn"]]
    file.write_text(json.dumps(cached))  # now routing qkv to oneDNN, a form those weights lack
    with pytest.raises(RuntimeError, match="forms the build did not make"):
        tune()
    file.unlink()
    with pytest.raises(RuntimeError, match="is gone"):
        tune()
