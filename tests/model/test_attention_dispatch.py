"""The measured attention route (model/attention_dispatch.py), driven by fake timings: where the tiled kernel takes
over in each kind of step, which form the bf16 tiles take, what is cached and reused, what PAGEDLLM_ATTENTION
forces; and that the kernel follows the route it is given. No timing assertions: the timer is a function the test
writes."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from test_attention import make_batch

from pagedllm import LLM
from pagedllm.model import attention_dispatch as ad
from pagedllm.model import kernels, machine_cache
from pagedllm.model.attention import STATIC_ROUTE, AttentionRoute

SHAPE = ad.AttentionShape(6, 2, 32, torch.float32, torch.float32, 16)
BF16 = ad.AttentionShape(6, 2, 32, torch.bfloat16, torch.bfloat16, 16)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own cache folder, nothing forced, an idle machine, small pools (the timings are fake)."""
    monkeypatch.setenv(machine_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(ad.FORCE_ENV, raising=False)
    monkeypatch.setattr(machine_cache, "machine_load", lambda: 0.0)
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 0.0)
    monkeypatch.setattr(ad, "cold_bytes", lambda: 1 << 20)
    monkeypatch.setattr(ad, "BUDGET_S", math.inf)
    monkeypatch.setattr(machine_cache, "_unsaved", {})


@pytest.fixture(scope="module")
def ext():
    return kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")


def crossing_at(busy: int, few: int, calls: list | None = None) -> ad.Timer:
    """Fake timings: the row kernel costs `rows`, the tiled one a fixed cost that the row kernel passes at `busy`
    (or `few`) rows; the pairs form of the tiles half the fp32 form's; flash attention twice the tiles' on prompts."""
    def timer(what, kernel, rows, run):
        if calls is not None:
            calls.append((what, kernel, rows))
        if what == "prompt":
            return {"pairs": 1.0, "fp32": 2.0}[kernel]
        if what == "chunk":
            return {"tile": 1.0, "sdpa": 2.0}[kernel] * rows
        return float(rows) if kernel == "rows" else {"busy": busy, "few": few}[what] - 0.5
    return timer


def test_the_tiled_kernel_takes_over_where_it_is_faster_in_each_kind_of_step(ext):
    calls = []
    table = ad.measure(SHAPE, crossing_at(busy=40, few=10, calls=calls))
    # each regime bisected between its ends (3 and 192 rows) down to adjacent counts either side of its crossing
    assert table.rows["busy"] == [3, 24, 36, 48, 72, 192] and table.rows["few"] == [3, 9, 12, 24, 192]
    route = table.route()
    # busy: the row kernel won at 36 rows, the tiled one at 48: the boundary at their geometric midpoint
    assert route == AttentionRoute(math.isqrt(36 * 48) + 1, math.isqrt(9 * 12) + 1, True)
    assert not table.tile_forms and not any(what == "prompt" for what, _, _ in calls)  # fp32: one tile form
    # each count: a warm-up and ad.SAMPLES samples per kernel, interleaved
    assert calls[:4] == [("few", "rows", 3), ("few", "tile", 3)] * 2
    # the regimes in turn, each count once
    counts = list(dict.fromkeys((what, rows) for what, _, rows in calls))
    assert counts[:6] == [("few", 3), ("busy", 3), ("few", 192), ("busy", 192), ("few", 24), ("busy", 24)]


def fake_clock(monkeypatch, timer: ad.Timer) -> ad.Timer:
    """measure's clock advanced by each fake call's seconds."""
    now = [0.0]
    monkeypatch.setattr(ad, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def timed(what, kernel, rows, run):
        seconds = timer(what, kernel, rows, run)
        now[0] += seconds
        return seconds
    return timed


def test_a_spent_budget_costs_both_regimes_resolution_not_their_measurement(ext, monkeypatch):
    """Calls cost their fake seconds: the few-sequence steps' 3 rows take 50, the busy ones' 170, the 192 rows 806
    and 926. A budget spent by the ends leaves each regime its ends (the boundary between them); one spent after
    the first count each, where the row kernel won, keeps the hand-set route (that count is a lower bound only)."""
    timer = fake_clock(monkeypatch, crossing_at(busy=40, few=10))
    table = ad.measure(SHAPE, timer, budget_s=1500)
    assert table.rows == {"busy": [3, 192], "few": [3, 192]}
    assert table.route() == AttentionRoute(math.isqrt(3 * 192) + 1, math.isqrt(3 * 192) + 1, True)
    short = ad.measure(SHAPE, timer, budget_s=100)
    assert short.rows == {"busy": [3], "few": [3]} and short.route() == STATIC_ROUTE


def test_steps_of_few_sequences_are_timed_as_a_mix_up_to_one_short_of_four_per_thread(two_threads):
    """A run's tail has 1 to 4T-1 sequences: one of each end and two per thread, each call running all three; a
    busy step has 8 per thread."""
    gen = torch.Generator().manual_seed(0)
    assert [len(lens) for lens in ad.step_contexts("few", gen)] == [1, 4, 7]
    assert [len(lens) for lens in ad.step_contexts("busy", gen)] == [16]
    ran = []
    calls = ad.together([[lambda: ran.append("a0"), lambda: ran.append("a1")], [lambda: ran.append("b0")]])
    for call in calls:
        call()
    assert ran == ["a0", "b0", "a1", "b0"]


def test_a_regime_the_tiled_kernel_wins_at_its_fewest_queries_times_nothing_more(ext):
    calls = []
    ad.measure(SHAPE, crossing_at(busy=1, few=1, calls=calls))
    assert {rows for what, _, rows in calls if what == "busy"} == {3}


@pytest.mark.parametrize(("busy", "expected"), [(1, 1), (10**6, 3 * 64 + 1)],
                         ids=["tile-everywhere", "rows-everywhere"])
def test_one_kernel_winning_everywhere(ext, busy, expected):
    """Tiles from the first row; or the row kernel up to the biggest count timed and the tiled one past it."""
    assert ad.measure(SHAPE, crossing_at(busy=busy, few=busy)).route().tile_min_rows == expected


def test_a_spent_budget_keeps_the_static_route(ext):
    table = ad.measure(SHAPE, crossing_at(busy=40, few=10), budget_s=0.0)
    assert table.rows == {"busy": [], "few": []} and table.route() == STATIC_ROUTE


@pytest.mark.parametrize(("pairs", "fp32", "chosen"), [(1.0, 2.0, True), (1.0, 1.02, False), (2.0, 1.0, False)],
                         ids=["pairs-faster", "a-tie-keeps-fp32", "fp32-faster"])
def test_the_bf16_tile_form_is_measured_where_the_cpu_has_both(ext, pairs, fp32, chosen):
    if not ext.tile_pairs_supported():
        pytest.skip("no AVX512-BF16: the tiles have one form here")

    def timer(what, kernel, rows, run):
        return {"pairs": pairs, "fp32": fp32}[kernel] if what == "prompt" else crossing_at(40, 10)(what, kernel,
                                                                                                     rows, run)
    table = ad.measure(BF16, timer)
    assert set(table.tile_forms) == {"pairs", "fp32"} and table.route().tile_pairs is chosen


@pytest.mark.parametrize(("f16", "fp32", "chosen"), [(1.0, 2.0, True), (1.0, 1.02, False), (2.0, 1.0, False)],
                         ids=["f16-faster", "a-tie-keeps-fp32", "fp32-faster"])
def test_the_fp16_tile_form_is_measured_only_where_auto_allows_it(ext, f16, fp32, chosen):
    """fp32 queries over a bf16 cache: the fp16-products form is timed against the fp32 one where the shape allows it
    (`--dtype auto` chose fp32) and the build has AVX512-FP16; taken only where it wins by more than TIE. Without the
    allowance nothing is timed (an explicit float32 stays exact), and the two shapes are cached apart."""
    if not ext.tile_f16_supported():
        pytest.skip("no AVX512-FP16: the fp32 tiles have one form here")
    allowed = ad.AttentionShape(6, 2, 32, torch.float32, torch.bfloat16, 16, f16=True)
    exact = ad.AttentionShape(6, 2, 32, torch.float32, torch.bfloat16, 16)

    def timer(what, kernel, rows, run):
        return {"f16": f16, "fp32": fp32}[kernel] if what == "prompt" else crossing_at(40, 10)(what, kernel, rows,
                                                                                                 run)
    table = ad.measure(allowed, timer)
    assert set(table.tile_forms) == {"f16", "fp32"} and table.route().tile_f16 is chosen
    assert table.route().tile_pairs  # the bf16 queries' form is not in question here
    assert ("with fp16 products" if chosen else "fp32 tiles in fp32") in table.summary()
    plain = ad.measure(exact, timer)
    assert plain.tile_forms == {} and not plain.route().tile_f16
    assert allowed.key() != exact.key() and exact.key() == ad.AttentionShape(6, 2, 32, torch.float32,
                                                                             torch.bfloat16, 16).key()


def test_the_route_is_cached_per_machine_and_shape_and_reused(ext, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pagedllm")
    first, table = ad.tune(SHAPE, timer=crossing_at(busy=40, few=10))
    assert table is not None and "measured in" in caplog.text
    assert list((tmp_path / "cache").glob("attention-*.json"))
    calls = []
    again, _ = ad.tune(SHAPE, timer=crossing_at(busy=10**6, few=10**6, calls=calls))
    assert again == first and not calls and "read from" in caplog.text
    other, _ = ad.tune(ad.AttentionShape(6, 3, 32, torch.float32, torch.float32, 16), timer=crossing_at(10**6, 10**6))
    assert other.tile_min_rows == 2 * 64 + 1  # another shape: measured for itself


def test_a_route_measured_while_others_held_the_cores_is_not_kept(ext, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pagedllm")
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 1.0)
    first, _ = ad.tune(SHAPE, timer=crossing_at(busy=40, few=10))
    assert "not cached" in caplog.text and not list((tmp_path / "cache").glob("attention-*.json"))
    calls = []  # this process's next engine of the same shape: the busy table again, not timed again
    again, _ = ad.tune(SHAPE, timer=crossing_at(busy=10**6, few=10**6, calls=calls))
    assert again == first and not calls and "measured earlier in this process" in caplog.text
    monkeypatch.setattr(machine_cache, "_unsaved", {})  # another process: measured again
    ad.tune(SHAPE, timer=crossing_at(busy=10**6, few=10**6, calls=calls))
    assert calls


def test_the_environment_keeps_the_static_route(ext, monkeypatch):
    monkeypatch.setenv(ad.FORCE_ENV, "static")
    calls = []
    assert ad.tune(SHAPE, timer=crossing_at(40, 10, calls)) == (STATIC_ROUTE, None) and not calls
    monkeypatch.setenv(ad.FORCE_ENV, "fastest")
    with pytest.raises(ValueError, match=ad.FORCE_ENV):
        ad.tune(SHAPE)


def test_a_shape_the_kernel_does_not_run_is_not_measured(ext):
    calls = []
    odd = ad.AttentionShape(6, 2, 40, torch.float32, torch.float32, 16)  # head_dim not a multiple of 16
    assert ad.tune(odd, timer=crossing_at(40, 10, calls)) == (STATIC_ROUTE, None) and not calls


def test_the_engine_sets_and_logs_its_attention_route(ext, tiny_model_dir, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="pagedllm")
    llm = LLM(model=tiny_model_dir, kv_cache_memory="16MiB", dtype="float32")
    route = llm.engine.runner.model.attention_route
    assert isinstance(route, AttentionRoute) and "attention (measured in" in caplog.text
    assert list((tmp_path / "cache").glob("attention-*.json"))


# ---- the kernel follows the route ----------------------------------------------------------------------------------
def forced(b, route: AttentionRoute) -> torch.Tensor:
    from pagedllm.model.attention import cpp_attention
    return cpp_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.query_start_loc,
                         b.q.shape[-1] ** -0.5, b.max_query_len, route)


ROWS, TILE = AttentionRoute(10**9, 10**9), AttentionRoute(1, 1)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_few_sequences_take_their_own_threshold(ext, two_threads):
    """One sequence (fewer than 4 per thread): few_tile_min_rows decides; 16 sequences: tile_min_rows. The two
    kernels' bf16 outputs differ in their last bits, so which one ran shows."""
    one = make_batch([(300, 24)], 9, 3, 64, 16, torch.bfloat16)
    assert not torch.equal(forced(one, ROWS), forced(one, TILE))
    assert torch.equal(forced(one, AttentionRoute(10**9, 1)), forced(one, TILE))
    many = make_batch([(100 + i, 8) for i in range(16)], 9, 3, 64, 16, torch.bfloat16)
    assert not torch.equal(forced(many, ROWS), forced(many, TILE))
    assert torch.equal(forced(many, AttentionRoute(10**9, 1)), forced(many, ROWS))
    assert torch.equal(forced(many, AttentionRoute(24, 10**9)), forced(many, TILE))  # 8 queries x 3 heads = 24 rows


def test_the_fp32_tile_form_runs_when_the_route_says_so(ext):
    """bf16 tiles in fp32 sum fp32 products of the bf16 values (closer to the fp32 reference than the pairs form,
    which rounds the probabilities to bf16); both match the reference at bf16's tolerance."""
    b = make_batch([(333, 333), (100, 37)], 9, 3, 64, 16, torch.bfloat16)
    pairs, plain = forced(b, TILE), forced(b, AttentionRoute(1, 1, False))
    reference = b.run("reference")
    torch.testing.assert_close(plain, reference, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(pairs, reference, rtol=1e-2, atol=1e-2)
    if ext.tile_pairs_supported():
        assert not torch.equal(pairs, plain)
        error = {name: (out.float() - reference.float()).abs().mean() for name, out in (("pairs", pairs),
                                                                                       ("plain", plain))}
        assert error["plain"] < error["pairs"]
    else:
        assert torch.equal(pairs, plain)


def flash_from(tokens: int, gain: float) -> ad.Timer:
    """Fake timings: flash attention `gain` times the tiled kernel's speed on prompts of `tokens` or more, slower on
    shorter ones; the rest as crossing_at(40, 10)."""
    def timer(what, kernel, rows, run):
        if what != "chunk":
            return crossing_at(40, 10)(what, kernel, rows, run)
        queries = rows // BF16.group
        return float(queries) / (gain if kernel == "sdpa" and queries >= tokens else 0.5 if kernel == "sdpa" else 1)
    return timer


@pytest.mark.parametrize(("tokens", "gain", "expected", "timed"),
                         [(512, 2.0, math.isqrt(256 * 512) + 1, [1024, 512, 256]),
                          (128, 2.0, ad.CHUNK_QUERIES[0], [1024, 512, 256, 128]),
                          (512, 1.1, 0, [1024]),
                          (10**6, 2.0, 0, [1024])],
                         ids=["from-512", "from-the-fewest", "within-the-margin", "never"])
def test_bf16_prompts_take_flash_attention_where_it_wins_by_the_margin(ext, tokens, gain, expected, timed):
    """Steps of 1,024 prompt tokens in prompts of 1,024 down to 128 tokens, until flash attention no longer wins by
    more than CHUNK_MARGIN; the boundary at the geometric midpoint below the shortest of its wins."""
    calls = []

    def timer(what, kernel, rows, run):
        calls.append((what, kernel, rows))
        return flash_from(tokens, gain)(what, kernel, rows, run)
    table = ad.measure(BF16, timer)
    assert [rows // BF16.group for rows in dict.fromkeys(r for what, _, r in calls if what == "chunk")] == timed
    assert table.route().sdpa_min_queries == expected
    assert (f"from {expected} queries on torch's flash attention" if expected
            else "no chunk on torch's flash attention") in table.summary()


def test_fp32_prompts_are_not_timed_on_flash_attention(ext):
    calls = []
    table = ad.measure(SHAPE, crossing_at(40, 10, calls))
    assert not table.chunks and table.route().sdpa_min_queries == 0
    assert not any(what == "chunk" for what, _, _ in calls)


def test_a_cached_route_keeps_its_flash_attention_boundary(ext):
    first, _ = ad.tune(BF16, timer=flash_from(512, 2.0))
    again, _ = ad.tune(BF16, timer=flash_from(10**6, 2.0))
    assert again == first and first.sdpa_min_queries == math.isqrt(256 * 512) + 1
