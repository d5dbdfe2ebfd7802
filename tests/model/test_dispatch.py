"""The measured kernel choice (model/dispatch.py), driven by fake timings: which path wins each row count, how a
route reads the winners, what is cached and reused, what PAGEDLLM_KERNEL forces, and bounded shapes (decided by
a new primitive's cost against padding's, or PAGEDLLM_PAD_ROWS). No timing assertions: the timer is a function of
(kind, path, rows) the test writes."""

from __future__ import annotations

import logging
import math
import statistics

import pytest
import torch

from pagedllm import LLM
from pagedllm.model import dispatch, kernel_timing, kernels, machine_cache
from pagedllm.model.layers import BIGGEST, Int8Weight, PackedWeight, linear, padded_rows, static_route


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own cache folder, nothing forced, an idle machine."""
    monkeypatch.setenv(machine_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    monkeypatch.delenv(dispatch.PAD_ENV, raising=False)
    monkeypatch.delenv(dispatch.CAPACITY_ENV, raising=False)  # oneDNN's own 1,024: room for bounded shapes
    monkeypatch.setattr(machine_cache, "machine_load", lambda: 0.0)
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 0.0)
    monkeypatch.setattr(machine_cache, "_unsaved", {})
    monkeypatch.setattr(kernel_timing, "BUDGET_S", math.inf)  # fake times are no seconds: budget tests pass their own
    monkeypatch.setattr(kernel_timing, "LONG_CALL_S", math.inf)  # nor long calls: that test sets its own
    yield


@pytest.fixture(scope="module")
def ext():
    """The int8 kernel (VNNI, or AVX2's vpmaddubsw) is the fake timings' second path: a build without it runs no
    int8, so the dispatch's tests skip there."""
    ext = kernels.load() or pytest.skip(f"kernels did not build: {kernels.build_error()}")
    if not ext.int8_gemm_supported():
        pytest.skip("no int8_gemm in this build: no int8 path to time")
    return ext


class FakeTimer:
    """Seconds per call from a table of per-row costs; counts the calls per (kind, path, rows). A cold oneDNN call
    (a new primitive, "onednn_cold") costs oneDNN's, plus its fixed cost if one is given."""

    def __init__(self, per_row: dict[str, float], fixed: dict[str, float] | None = None) -> None:
        self.per_row, self.fixed = per_row, fixed or {}
        self.calls: dict[tuple[str, str, int], int] = {}

    def __call__(self, kind: str, path: str, rows: int, run) -> float:
        self.calls[kind, path, rows] = self.calls.get((kind, path, rows), 0) + 1
        return self.fixed.get(path, 0.0) + self.per_row[path.removesuffix("_cold")] * rows


PLAIN = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 0.1


def weights(ext=None, layers: int = 2) -> dict[str, list[PackedWeight]]:
    """Two kinds: qkv with an int8 form when `ext` is given, o with oneDNN's only."""
    return {"qkv": [PackedWeight(PLAIN, int8=Int8Weight(PLAIN, ext) if ext else None) for _ in range(layers)],
            "o": [PackedWeight(PLAIN)]}


def table(times: dict[str, dict[str, list[float | None]]], buckets: list[int]) -> dispatch.KernelTable:
    return dispatch.KernelTable({kind: buckets for kind in times}, times)


def test_a_route_takes_each_winner_up_to_the_geometric_midpoint():
    t = table({"qkv": {"int4": [1, 2, 9, 9], "bf16_gemm": [2, 1, 8, 5], "onednn": [3, 3, 7, 4]}}, [1, 4, 16, 64])
    assert t.winners("qkv") == ["int4", "bf16_gemm", "onednn", "onednn"]
    assert t.route("qkv") == ((2, "int4"), (8, "bf16_gemm"), (BIGGEST, "onednn"))
    assert t.summary() == "qkv: int4 <=2, bf16_gemm <=8, onednn"
    tie = table({"qkv": {"int8": [100.0, 100.0], "onednn": [102.0, 110.0]}}, [1, 2])
    assert tie.winners("qkv") == ["onednn", "int8"]  # within TIE oneDNN keeps it
    island = table({"lm_head": {"int8": [1, 9, 1, 1], "onednn": [2, 2, 2, 2]}}, [1, 2, 4, 8])
    assert island.winners("lm_head") == ["int8"] * 4  # one row count alone: noise


def test_a_row_count_not_timed_takes_the_nearest_timed_winner():
    """Every other path pruned: the last timed winner serves the bigger batches. Out of budget with the biggest row
    count timed (the anchor), the untimed ones between go to the nearer of the two (the smaller on a tie)."""
    t = table({"qkv": {"int8": [1, 1, None], "onednn": [2, 2, None]}, "o": {"onednn": [None, None, None]}},
              [1, 2, 4])
    assert t.route("qkv") == ((BIGGEST, "int8"),)
    assert t.route("o") == ((BIGGEST, "onednn"),)
    cut = table({"qkv": {"int4": [1, 1, None, None, None, None, 9], "onednn": [2, 2, None, None, None, None, 3]}},
                [1, 2, 4, 8, 16, 32, 64])
    assert cut.winners("qkv") == ["int4"] * 4 + ["onednn"] * 3  # by distance in the table: 8 rows nearer 2, 16 64
    assert cut.route("qkv") == ((11, "int4"), (BIGGEST, "onednn"))


def test_a_spent_budget_still_finds_where_the_small_batch_kernel_stops_winning(ext, monkeypatch):
    """A 1B model's calls are slow enough that 2.5 s times a few row counts only. Taken smallest first, they all
    went to 1-8 rows and the small-batch kernel took every batch up to the biggest's geometric midpoint; coarse to
    fine (1 row, the biggest, then midway where the winners differ) the same four row counts find the crossover.
    The biggest is timed once (one warm-up, ANCHOR_SAMPLES samples) as soon as 1 row is."""
    clock = iter(range(1000))
    monkeypatch.setattr(kernel_timing.time, "perf_counter", lambda: float(next(clock)))  # a second per look

    class Amx(FakeTimer):  # int8 here stands for the small-batch kernel: it wins up to 8 rows
        def __call__(self, kind, path, rows, run):
            super().__call__(kind, path, rows, run)
            return ({"int8": 1.0, "onednn": 4.0} if rows <= 8 else {"int8": 90.0, "onednn": 10.0})[path] * 1e-6
    timer = Amx({"int8": 0.0, "onednn": 0.0})
    t = dispatch.measure(weights(ext, layers=1), torch.float32, timer, budget_s=4.5)  # four looks at the clock
    assert sorted({rows for _, _, rows in timer.calls}) == [1, 4, 32, 1024]
    assert timer.calls["qkv", "onednn", 1024] == timer.calls["qkv", "int8", 1024] == kernel_timing.ANCHOR_SAMPLES + 1
    assert t.winners("qkv") == ["int8"] * 4 + ["onednn"] * 7  # 8 rows nearer 4 than 32, 16 nearer 32
    assert t.route("qkv") == ((11, "int8"), (BIGGEST, "onednn"))


def test_a_long_warm_up_is_one_of_its_paths_samples(ext, monkeypatch):
    """Where every path's warm-up call takes LONG_CALL_S or more (what it pays once is a small part of it), it
    counts as a sample, and where several are taken each path is called once fewer: at 64 rows SAMPLES calls, at
    8 (short calls) a warm-up and SAMPLES; the biggest row count's single sample stays two calls (then its other
    samples). A call costs 1 s a row; each path's first call at 64 and 512 rows is faster, and is the one kept."""
    monkeypatch.setattr(kernel_timing, "LONG_CALL_S", 50.0)
    monkeypatch.setattr(kernel_timing, "BUCKETS", (1, 8, 64, 512))

    class FirstFaster(FakeTimer):
        def __call__(self, kind, path, rows, run):
            seconds = super().__call__(kind, path, rows, run)
            return seconds - 10 if rows >= 64 and self.calls[kind, path, rows] == 1 else seconds
    timer = FirstFaster({"int8": 1.0, "onednn": 1.0})
    t = dispatch.measure(weights(ext, layers=1), torch.float32, timer)
    calls = {rows: {timer.calls["qkv", p, rows] for p in ("int8", "onednn")} for rows in (8, 64, 512)}
    assert calls == {8: {kernel_timing.SAMPLES + 1}, 64: {kernel_timing.SAMPLES},
                     512: {kernel_timing.ANCHOR_SAMPLES + 1 + kernel_timing.SAMPLES - kernel_timing.ANCHOR_SAMPLES}}
    assert [t.times["qkv"][p][2:] for p in ("int8", "onednn")] == [[54.0, 502.0]] * 2


@pytest.mark.parametrize("budget, timed, at_512", [(50, {1, 512}, kernel_timing.ANCHOR_SAMPLES + 1),
                                                    (100, {1, 8, 512}, kernel_timing.ANCHOR_SAMPLES + 1),
                                                    (600, {1, 8, 64, 512}, kernel_timing.ANCHOR_SAMPLES + 1),
                                                    (5000, {1, 8, 64, 512}, kernel_timing.SAMPLES + 1)])
def test_the_budget_holds_the_row_count_it_times_and_the_biggest(ext, monkeypatch, budget, timed, at_512):
    """Before each row count the engine projects what it would take, each path on the line through the nearest
    timed row counts either side (a call here costs 1 s plus 1 s a row: after 1 and 512 rows, 8 rows' four calls a
    path 4 x 9 x 2 = 72 s, then 64 rows' 4 x 65 x 2 = 520 s), and stops where that passes the budget. The biggest is
    timed once right after 1 row whatever the budget, and given its other samples at the end where they fit (2 more
    a path, 2 x 513 x 2 = 2,052 s)."""
    monkeypatch.setattr(kernel_timing, "BUCKETS", (1, 8, 64, 512))
    monkeypatch.setattr(kernel_timing.time, "perf_counter", lambda: 0.0)  # no time passes: only the projection counts
    timer = FakeTimer({"int8": 1.0, "onednn": 1.0}, fixed={"int8": 1.0, "onednn": 1.0})
    dispatch.measure(weights(ext, layers=1), torch.float32, timer, budget_s=budget)
    assert {rows for _, _, rows in timer.calls} == timed
    assert timer.calls["qkv", "int8", 512] == timer.calls["qkv", "onednn", 512] == at_512


def test_the_next_row_count_is_midway_where_the_winners_differ():
    """After 1 row and the biggest, the widest gap whose two ends have different winners is split first; with none
    left, the widest gap; a row count where one path is left to compare is not timed."""
    none = [None] * 11
    times = {"int4": [1.0, *none[1:]], "onednn": [2.0, *none[1:]]}
    assert kernel_timing.next_bucket(times) == 10
    times["int4"][10], times["onednn"][10] = 9.0, 3.0
    assert kernel_timing.next_bucket(times) == 5
    times["int4"][5], times["onednn"][5] = 2.0, 2.5  # the 4-bit kernel still wins at 32 rows: split 32-1,024
    assert kernel_timing.next_bucket(times) == 7
    times["int4"][7], times["onednn"][7] = 3.0, 2.9
    assert kernel_timing.next_bucket(times) == 6  # 64 rows: between 32 (int4) and 128 (onednn)
    times["int4"][6], times["onednn"][6] = 2.4, 2.6
    assert kernel_timing.next_bucket(times) == 2  # no gap's winners differ now: the widest, 1-32 rows
    pruned = {"int4": [1.0, 5.0, *none[2:]], "onednn": [2.0, 2.0, *none[2:]]}  # 2.5x behind and falling: dropped
    assert not kernel_timing.anchor_due(pruned, 10)  # nothing left to compare there: not timed, nor budgeted for
    pruned["int4"][10], pruned["onednn"][10] = 9.0, 3.0
    assert kernel_timing.compared(pruned, 5) == ["onednn"] and kernel_timing.next_bucket(pruned) is None
    assert kernel_timing.anchor_due({"int4": [1.0, None], "onednn": [2.0, None]}, 1)


def test_measure_keeps_the_fastest_and_prunes_the_slow_small_batch_path(ext, monkeypatch):
    """int8 costs a fixed overhead (wins nothing at 1 row) and less per row: timed on, it wins the big batches. Once a
    path is over PRUNE x the winner and falling further behind it is not timed again, while oneDNN always is; a kind
    with one path is not timed at all."""
    monkeypatch.setattr(kernel_timing, "BUCKETS", (1, 8, 64, 512))
    w = weights(ext, layers=1)  # the fake's times are per sample: one weight a sample at every row count
    timer = FakeTimer({"int8": 1.0, "onednn": 2.0}, fixed={"int8": 20.0})
    t = dispatch.measure(w, torch.float32, timer)
    assert t.winners("qkv") == ["onednn", "onednn", "int8", "int8"]
    assert not any(kind == "o" for kind, _, _ in timer.calls)
    assert set(timer.calls.values()) == {kernel_timing.SAMPLES + 1}  # one warm-up, then the timed samples
    slow = FakeTimer({"int8": 10.0, "onednn": 1.0}, fixed={"int8": -5.0})  # 5x behind at 1 row, 9.4x at 8
    t = dispatch.measure(w, torch.float32, slow)
    assert ("qkv", "int8", 8) in slow.calls and ("qkv", "int8", 64) not in slow.calls
    assert ("qkv", "onednn", 64) not in slow.calls  # oneDNN alone: nothing left to compare
    assert t.route("qkv") == ((BIGGEST, "onednn"),)


def test_a_path_is_pruned_by_its_distance_to_onednn_not_to_the_winner():
    """bf16_gemm 2.3x behind the 4-bit kernel at 1-2 rows (a third of the bytes) but ahead of oneDNN goes on to the
    row counts it wins; the 4-bit kernel past 2x oneDNN's time, and falling further behind, stops."""
    small = {"int4": [1.0, 1.0], "bf16_gemm": [2.3, 2.4], "onednn": [3.0, 3.1]}
    assert not kernel_timing.falling_behind(small, "bf16_gemm", 1)
    big = {"int4": [3.0, 7.0], "bf16_gemm": [2.0, 3.5], "onednn": [2.0, 3.0]}
    assert kernel_timing.falling_behind(big, "int4", 1) and not kernel_timing.falling_behind(big, "bf16_gemm", 1)
    assert not kernel_timing.falling_behind(big, "onednn", 1)


def test_each_sample_runs_on_weights_no_earlier_sample_touched():
    """Up to COLD_MAX_ROWS a sample's weights are other layers than the samples before it (a step reads each layer
    once, from memory), wrapping round the model's layers; bigger calls run on one weight."""
    layers = [PackedWeight(PLAIN) for _ in range(30)]
    groups = kernel_timing.sample_groups(layers, kernel_timing.COLD_MAX_ROWS, 3)
    ids = [[id(w) for w in g] for g in groups]
    assert all(len(g) == kernel_timing.COLD_WEIGHTS for g in ids)
    assert len({i for g in ids for i in g}) == 3 * kernel_timing.COLD_WEIGHTS  # 24 distinct of 30
    assert kernel_timing.sample_groups(layers, kernel_timing.COLD_MAX_ROWS, 4)[3][-2:] == layers[:2]  # wrapped
    assert kernel_timing.sample_groups(layers, kernel_timing.COLD_MAX_ROWS + 1, 2) == [layers[:1]] * 2
    assert kernel_timing.sample_groups(layers[:2], 1, 2) == [layers[:2], layers[:2]]


def test_the_lm_heads_int8_paths_are_timed_into_one_kept_output(ext, monkeypatch):
    """As the greedy logits pass runs them (LlamaModel._scratch_logits): a fresh output at each call faulted its pages
    in at each new row count and made the int8 kernel lose the biggest row count it was timed at once. Other kinds
    make their own outputs, as in a step."""
    head, qkv = Int8Weight(PLAIN, ext, int_mm=True), Int8Weight(PLAIN, ext, int_mm=True)
    outs: dict[int, list[tuple[int, torch.Tensor | None]]] = {id(head): [], id(qkv): []}
    real = Int8Weight.mm

    def recording(self, x, bias=None, kernel=None, out=None):
        outs[id(self)].append((x.shape[0], out))
        return real(self, x, bias, kernel, out)

    monkeypatch.setattr(Int8Weight, "mm", recording)
    for kind, weight in (("lm_head", head), ("qkv", qkv)):
        packed = PackedWeight(PLAIN, int8=weight)
        paths = [p for p in kernel_timing.PATHS if p in packed.paths()]  # int8_mm too where oneDNN's int8 is exact
        times = {p: [None] * 8 for p in paths}
        kernel_timing.time_bucket([packed], kind, list(kernel_timing.LM_HEAD_BUCKETS), 5, paths, torch.float32,
                                  lambda k, p, r, run: (run(), 1e-3)[1], times)
        assert all(times[p][5] is not None for p in paths)
    int8_calls = (len(paths) - 1) * (kernel_timing.SAMPLES + 1)  # a warm-up and the samples of each int8 path
    assert len(outs[id(qkv)]) == int8_calls and all(out is None for _, out in outs[id(qkv)])
    assert len(outs[id(head)]) == int8_calls
    rows, first = outs[id(head)][0]
    assert first is not None and first.shape == (rows, PLAIN.shape[0]) == (32, 64)
    assert all(out is first for _, out in outs[id(head)])  # one buffer for every call, as a step's


def test_a_time_out_of_line_with_its_neighbour_is_measured_again(ext, monkeypatch):
    """A neighbour's load stalls the samples of one row count: 8 rows slower than 16 makes both be timed again, and
    the stall does not decide the winner."""
    monkeypatch.setattr(kernel_timing, "BUCKETS", (4, 8, 16))
    stalls = {("qkv", "int8", 8): kernel_timing.SAMPLES + 1}  # every sample of the first round at 8 rows

    class Stalled(FakeTimer):
        def __call__(self, kind, path, rows, run):
            t = super().__call__(kind, path, rows, run)
            if stalls.get((kind, path, rows), 0) > 0:
                stalls[kind, path, rows] -= 1
                return t + 1000.0
            return t
    timer = Stalled({"int8": 1.0, "onednn": 2.0})
    t = dispatch.measure(weights(ext, layers=1), torch.float32, timer)
    assert t.winners("qkv") == ["int8"] * 3
    assert timer.calls["qkv", "int8", 8] == 2 * (kernel_timing.SAMPLES + 1)


def test_a_stalled_once_over_at_the_biggest_row_count_is_measured_again(ext, monkeypatch):
    """Out of budget, the biggest row count has its once-over only (a warm-up and ANCHOR_SAMPLES): a stall there made
    a slower kernel take every batch past the last crossover. Out of line with the nearest timed row count below, it
    is timed again, past the budget, and the stall does not decide."""
    monkeypatch.setattr(kernel_timing, "BUCKETS", (1, 8, 64, 512))
    monkeypatch.setattr(kernel_timing.time, "perf_counter", lambda: 0.0)  # only the projection counts (600: see above)
    stalls = {("qkv", "int8", 512): kernel_timing.ANCHOR_SAMPLES + 1}

    class Stalled(FakeTimer):
        def __call__(self, kind, path, rows, run):
            t = super().__call__(kind, path, rows, run)
            if stalls.get((kind, path, rows), 0) > 0:
                stalls[kind, path, rows] -= 1
                return t + 1000.0  # 1,513 s: in line with 1 row's 2 s (below 1.5 x 512 x), not with 8 or 64 rows'
            return t
    timer = Stalled({"int8": 1.0, "onednn": 2.0}, fixed={"int8": 1.0, "onednn": 1.0})
    t = dispatch.measure(weights(ext, layers=1), torch.float32, timer, budget_s=600)
    assert t.winners("qkv") == ["int8"] * 4
    assert timer.calls["qkv", "int8", 512] == 2 * (kernel_timing.ANCHOR_SAMPLES + 1)


def test_the_table_is_cached_per_machine_and_model_and_reused(ext, monkeypatch, tmp_path, caplog):
    timer = FakeTimer({"int8": 1.0, "onednn": 2.0})
    caplog.set_level(logging.INFO, logger="pagedllm")
    w = weights(ext)
    first = dispatch.tune(w, torch.float32, "tiny", timer=timer)
    assert first is not None and timer.calls and "measured" in caplog.text
    assert all(x.route == ((BIGGEST, "int8"),) for x in w["qkv"])
    files = list((tmp_path / "cache").glob("kernels-*.json"))
    assert len(files) == 1
    timer.calls.clear()
    w2 = weights(ext)
    again = dispatch.tune(w2, torch.float32, "tiny", timer=timer)
    assert not timer.calls and again.times == first.times and "read from" in caplog.text
    assert all(x.route == ((BIGGEST, "int8"),) for x in w2["qkv"])
    # another thread count, or another model, is another table
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    dispatch.tune(weights(ext), torch.float32, "tiny", timer=timer)
    assert timer.calls and len(list((tmp_path / "cache").glob("kernels-*.json"))) == 2


def test_a_table_timed_on_other_kernel_sources_is_not_read(ext, monkeypatch, tmp_path):
    """After an upgrade that changed a kernel, its old timings would choose routes for code that is gone."""
    timer = FakeTimer({"int8": 1.0, "onednn": 2.0})
    dispatch.tune(weights(ext), torch.float32, "tiny", timer=timer)
    timer.calls.clear()
    dispatch.tune(weights(ext), torch.float32, "tiny", timer=timer)
    assert not timer.calls  # the same sources: read from the cache
    monkeypatch.setattr(kernels, "source_digest", lambda: "another-build")
    dispatch.tune(weights(ext), torch.float32, "tiny", timer=timer)
    assert timer.calls and len(list((tmp_path / "cache").glob("kernels-*.json"))) == 2


def test_the_source_digest_follows_the_kernels_sources(monkeypatch, tmp_path):
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }")
    monkeypatch.setattr(kernels, "_SOURCES", [source])
    monkeypatch.setattr(kernels, "_HEADERS", [])
    try:
        kernels.source_digest.cache_clear()
        before = kernels.source_digest()
        source.write_text("int f() { return 2; }")
        kernels.source_digest.cache_clear()
        assert kernels.source_digest() != before
    finally:
        kernels.source_digest.cache_clear()  # the real sources' digest again for the tests after this one


def test_both_kernel_tables_are_keyed_by_the_kernels_sources():
    from pagedllm.model.attention_dispatch import AttentionShape

    shape = AttentionShape(4, 2, 16, torch.float32, torch.float32, 16)
    assert shape.key()["build"] == dispatch.prebuild_key(torch.float32, "tiny")["build"] == kernels.source_digest()


def test_a_table_measured_on_a_busy_machine_is_not_kept(ext, monkeypatch, tmp_path):
    monkeypatch.setattr(machine_cache, "machine_load", lambda: 64.0)
    dispatch.tune(weights(ext), torch.float32, "tiny",
                  timer=FakeTimer({"int8": 1.0, "onednn": 2.0}))
    assert not list((tmp_path / "cache").glob("kernels-*.json"))


def test_a_table_measured_while_others_held_the_cores_is_not_kept(ext, monkeypatch, tmp_path, caplog):
    """The load average lags a neighbour that just started; the CPU time others used meanwhile does not."""
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 0.9)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        dispatch.tune(weights(ext), torch.float32, "tiny", timer=FakeTimer({"int8": 1.0, "onednn": 2.0}))
    assert not list((tmp_path / "cache").glob("kernels-*.json")) and "other processes used 0.90 CPUs" in caplog.text
    # this process's next build of the same model reuses it: the cores are as busy as they were a moment ago
    timer = FakeTimer({"int8": 1.0, "onednn": 2.0})
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        dispatch.tune(weights(ext), torch.float32, "tiny", timer=timer)
    assert not timer.calls and "measured earlier in this process" in caplog.text
    assert not list((tmp_path / "cache").glob("kernels-*.json"))
    monkeypatch.setattr(machine_cache, "_unsaved", {})  # another process
    monkeypatch.setattr(machine_cache, "others_since", lambda start: 0.1)  # below a quarter of a core: kept
    dispatch.tune(weights(ext), torch.float32, "tiny", timer=timer)
    assert timer.calls and len(list((tmp_path / "cache").glob("kernels-*.json"))) == 1


def test_routing_drops_the_forms_no_route_takes_and_linear_follows_the_route(ext):
    g = torch.Generator().manual_seed(1)
    plain = torch.randn(64, 32, generator=g)
    w = {"qkv": [PackedWeight(plain, int8=Int8Weight(plain * 2, ext))]}  # the int8 form answers twice as big
    x = torch.randn(3, 32, generator=g)
    dispatch.apply(table({"qkv": {"int8": [5.0], "onednn": [1.0]}}, [1]), w)
    weight = w["qkv"][0]
    assert weight.int8 is None and weight.paths() == {"onednn"}
    torch.testing.assert_close(linear(x, weight), x @ plain.T)
    w = {"qkv": [PackedWeight(plain, int8=Int8Weight(plain * 2, ext))]}
    dispatch.apply(table({"qkv": {"int8": [1.0], "onednn": [5.0]}}, [1]), w)
    assert w["qkv"][0].packed is None and w["qkv"][0].paths() == {"int8"}  # oneDNN's copy too, where unrouted
    out = linear(x, w["qkv"][0])
    assert ((out - 2 * x @ plain.T).norm() / out.norm()).item() < 0.03


@pytest.mark.parametrize("forced", ["onednn", "int8", "static"])
def test_the_environment_forces_a_path(ext, monkeypatch, tmp_path, forced):
    monkeypatch.setenv(dispatch.FORCE_ENV, forced)
    timer = FakeTimer({"int8": 1.0, "onednn": 2.0})
    w = weights(ext)
    assert dispatch.tune(w, torch.float32, "tiny", timer=timer) is None
    assert not timer.calls and not list((tmp_path / "cache").glob("*"))
    expected = static_route(w["qkv"][0].paths()) if forced == "static" else ((BIGGEST, forced),)
    assert w["qkv"][0].route == expected
    assert w["o"][0].route == ((BIGGEST, "onednn"),)  # no int8 form: its own route


def test_a_bad_forced_path_is_an_error(monkeypatch):
    monkeypatch.setenv(dispatch.FORCE_ENV, "amx")
    with pytest.raises(ValueError, match="PAGEDLLM_KERNEL"):
        dispatch.tune(weights(), torch.float32, "tiny")


def test_bounded_shapes_are_few_and_close():
    """Every row count up to 1,024 pads to one of few sizes, never below it nor more than 1/8 above."""
    sizes = {padded_rows(r) for r in range(1, 1025)}
    assert len(sizes) <= 80
    assert all(r <= padded_rows(r) <= max(r, r * 9 // 8) for r in range(1, 1025))
    assert padded_rows(16) == 16 and padded_rows(17) == 18 and padded_rows(1000) == 1024


def test_padded_rows_give_the_same_product(monkeypatch):
    monkeypatch.setenv(dispatch.PAD_ENV, "1")
    w = weights()
    dispatch.tune(w, torch.float32, "tiny", timer=FakeTimer({"onednn": 1.0}))
    assert all(weight.pad_rows for kind in w.values() for weight in kind)
    x = torch.randn(37, 32)
    out = linear(x, w["qkv"][0])
    assert padded_rows(37) != 37 and out.shape == (37, 64) and out.is_contiguous()
    torch.testing.assert_close(out, x @ PLAIN.T, rtol=1e-5, atol=1e-5)


def test_the_engine_logs_its_kernels(tiny_model_dir, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="pagedllm")
    LLM(model=tiny_model_dir, kv_cache_memory="16MiB", dtype="float32")
    assert "kernels (" in caplog.text and "qkv: " in caplog.text
    assert list((tmp_path / "cache").glob("kernels-*.json"))


def test_a_cpu_without_an_exact_int8_product_runs_no_int8(tiny_model_dir, monkeypatch):
    """Without VNNI oneDNN's int8 products saturate (vpmaddubsw's int16 pairs), and without AVX2 there is no int8_gemm
    either: `auto` keeps the lm_head in its plain form, and `--quantization w8a8` is refused at start-up with why,
    not run with wrong sums."""
    from pagedllm.model import bf16_choice

    monkeypatch.setattr(bf16_choice, "bf16_pays", lambda: False)  # auto: fp32, where the lm_head may go int8
    monkeypatch.setattr(kernels, "int8_available", lambda: False)
    llm = LLM(model=tiny_model_dir, kv_cache_memory="16MiB", threads=1)
    assert llm.engine.runner.model.lm_head_weight.int8 is None and not llm.engine.runner.model.int8
    with pytest.raises(ValueError, match="AVX2"):
        LLM(model=tiny_model_dir, kv_cache_memory="16MiB", threads=1, quantization="w8a8")


def test_without_vnni_int8_runs_only_on_the_kernel(ext, monkeypatch):
    """Where oneDNN's int8 products saturate, an int8 weight has the kernel's product only (no torch._int_mm form to
    route to), and a weight the kernel cannot take (inputs not in groups of 4) is refused, not run wrong."""
    monkeypatch.setattr(kernels, "int8_products_exact", lambda: False)
    plain = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    weight = PackedWeight(plain, int8=Int8Weight(plain, ext, int_mm=True))
    assert weight.paths() == {"int8", "onednn"}
    with pytest.raises(ValueError, match="groups of 4"):
        Int8Weight(torch.randn(64, 30), ext)


def test_int8_products_are_exact_only_with_vnni(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags : avx2 fma f16c")
    assert not kernels.int8_products_exact()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags : avx2 avx_vnni")
    assert kernels.int8_products_exact()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN capped below VNNI: its int8 products saturate again
    assert not kernels.int8_products_exact()


def test_auto_fp32_may_run_the_lm_head_in_int8_and_keeps_fp32_greedy(tiny_model_dir, monkeypatch):
    """Where `--dtype auto` is fp32 (no fast bf16), the lm_head's int8 form is a candidate, its top candidates
    rescored in fp32: greedy tokens equal an explicit float32 engine's, which keeps no int8 form at all."""
    from pagedllm import SamplingParams
    from pagedllm.model import bf16_choice

    if not kernels.int8_available():
        pytest.skip("no exact int8 product here: the engine runs no int8")

    monkeypatch.setattr(bf16_choice, "bf16_pays", lambda: False)
    monkeypatch.setenv(dispatch.FORCE_ENV, "int8")
    auto = LLM(model=tiny_model_dir, kv_cache_memory="16MiB", threads=1)
    exact = LLM(model=tiny_model_dir, kv_cache_memory="16MiB", dtype="float32", threads=1)
    assert auto.engine.runner.model.lm_head_weight.int8 is not None and not auto.engine.runner.model.exact_logits
    assert exact.engine.runner.model.lm_head_weight.int8 is None and exact.engine.runner.model.exact_logits
    prompts = [[1, 2000, 3000], [40000, 5, 6, 7], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours, ref = (llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                 for llm in (auto, exact))
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]


def test_an_int8_weight_offers_both_products_and_keeps_the_one_routed(ext):
    """With int_mm, the int8 form has the kernel's product and torch._int_mm's (oneDNN: AMX tiles where there are
    some): both candidates, and routing keeps only the winner's copy of the weight."""
    if not kernels.int8_products_exact():
        pytest.skip("no VNNI here: oneDNN's int8 products saturate, so there is no torch._int_mm form")
    plain = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    w = {"lm_head": [PackedWeight(plain, int8=Int8Weight(plain * 2, ext, int_mm=True))]}
    assert {"int8_mm", "onednn"} <= w["lm_head"][0].paths()
    dispatch.apply(table({"lm_head": {"int8": [3.0], "int8_mm": [1.0], "onednn": [5.0]}}, [1]), w)
    weight = w["lm_head"][0]
    assert weight.paths() == {"int8_mm"} and weight.int8.packed is None and weight.packed is None
    x = torch.randn(5, 32)
    out = linear(x, weight)
    assert ((out - 2 * x @ plain.T).norm() / out.norm()).item() < 0.03


def creation_costing(seconds: float) -> FakeTimer:
    """int8 wins qkv; o, oneDNN's alone, is the one kind routed to oneDNN: its new primitives cost `seconds` more."""
    return FakeTimer({"int8": 1.0, "onednn": 2.0}, fixed={"onednn_cold": seconds})


def padded_weights(w: dict[str, list[PackedWeight]]) -> set[bool]:
    return {weight.pad_rows for kind in w.values() for weight in kind}


@pytest.mark.parametrize("creation, bounded", [(50.0, True), (0.5, False)])
def test_bounded_shapes_where_new_primitives_cost_more_than_padding(ext, creation, bounded, caplog):
    """A step at a new row count pays one primitive per oneDNN-routed kind (cold - warm); padding pays the bucket's
    mean extra rows at the warm per-row time (2 s a row here), the median over the row counts timed."""
    caplog.set_level(logging.INFO, logger="pagedllm")
    w, timer = weights(ext), creation_costing(creation)
    t = dispatch.tune(w, torch.float32, "tiny", timer=timer)
    assert t.onednn_kinds == ["o"] and not any(k == "qkv" and p == "onednn_cold" for k, p, _ in timer.calls)
    fresh = [rows for _, path, rows in timer.calls if path == "onednn_cold"]
    assert t.miss_s == pytest.approx(creation)
    assert t.pad_s == pytest.approx(statistics.median(2.0 * dispatch.mean_padding(r) for r in fresh))
    assert t.bounded_shapes is bounded and padded_weights(w) == {bounded}
    assert f"bounded shapes {'on' if bounded else 'off'}" in caplog.text
    assert dispatch.primitive_cache_capacity(32, torch.float32, "tiny") == (dispatch.PADDED_CACHE_CAPACITY
                                                                              if bounded else 32)


def test_new_row_counts_are_new_to_the_process(ext):
    """Each measurement's row counts are odd (no bucket, no padded size) and differ from the last one's."""
    rounds = []
    for _ in range(2):
        timer = creation_costing(1.0)
        dispatch.measure_shapes(weights(ext), table({"o": {"onednn": [1.0]}}, [1]), torch.float32, timer,
                                budget_s=math.inf)
        rounds.append({rows for _, path, rows in timer.calls if path == "onednn_cold"})
    assert len(rounds[0]) == len(dispatch.FRESH_ROWS) and not rounds[0] & rounds[1]
    assert all(r % 2 and r > 16 and dispatch.padded_rows(r) != r for r in rounds[0] | rounds[1])


@pytest.mark.parametrize("budget, counts", [(1.0, 1), (10.0, 3)])
def test_a_row_count_whose_calls_would_pass_the_budget_is_not_timed(ext, budget, counts):
    """A fresh row count's three calls are projected from the table's oneDNN time (0.01 s a call at 1 row here, in
    proportion to the rows: 0.69 s at ~23 rows, 1.35 s at ~45, 2.7 s at ~91): past the budget it is not timed (the
    first always is)."""
    timer = creation_costing(0.0)
    dispatch.measure_shapes(weights(ext), table({"o": {"onednn": [0.01]}}, [1]), torch.float32, timer,
                            budget_s=budget)
    assert len({rows for _, path, rows in timer.calls if path == "onednn_cold"}) == counts


def test_new_row_counts_are_where_the_route_runs_onednn():
    """A kind the 4-bit kernel serves up to 362 rows is timed for bounded shapes above 362 rows, where its oneDNN
    primitives and padding cost what they cost in a step; a route that is oneDNN throughout, at FRESH_ROWS."""
    int4_first = ((362, "int4"), (BIGGEST, "onednn"))
    assert dispatch.fresh_rows(int4_first) == tuple(362 + r for r in dispatch.FRESH_ROWS)
    assert dispatch.fresh_rows(((BIGGEST, "onednn"),)) == dispatch.FRESH_ROWS
    inside = dispatch.fresh_rows(((181, "int4"), (400, "onednn"), (BIGGEST, "int8")))
    assert all(181 < r <= 400 and r % 2 and dispatch.padded_rows(r) != r for r in inside)


def test_bounded_shapes_are_timed_where_the_route_runs_onednn(ext):
    """qkv runs int8 up to 32 rows and oneDNN above: its new primitives and padding are timed above 32 rows only."""
    timer = creation_costing(1.0)
    t = table({"qkv": {"int8": [1.0, 9.0], "onednn": [2.0, 1.0]}}, [1, 1024])
    assert t.route("qkv") == ((32, "int8"), (BIGGEST, "onednn"))
    dispatch.measure_shapes(weights(ext), t, torch.float32, timer, budget_s=math.inf)
    timed = {rows for _, path, rows in timer.calls if path == "onednn_cold"}
    assert len(timed) == len(dispatch.FRESH_ROWS) and min(timed) > 32


def test_the_decision_round_trips_through_the_cache_and_sizes_onednn_before_the_build(ext, tmp_path):
    first = dispatch.tune(weights(ext), torch.float32, "tiny", timer=creation_costing(50.0), variant="a")
    timer = creation_costing(0.0)
    w = weights(ext)
    again = dispatch.tune(w, torch.float32, "tiny", timer=timer, variant="a")
    assert not timer.calls and padded_weights(w) == {True}
    assert (again.bounded_shapes, again.miss_s, again.pad_s, again.onednn_kinds) == (
        first.bounded_shapes, first.miss_s, first.pad_s, first.onednn_kinds) == (True, 50.0, first.pad_s, ["o"])
    # found before the weights exist (the model's build creates oneDNN's first primitive); per model and variant
    assert dispatch.primitive_cache_capacity(32, torch.float32, "tiny", "a") == dispatch.PADDED_CACHE_CAPACITY
    dispatch.tune(weights(ext), torch.float32, "tiny", timer=creation_costing(0.0), variant="b")  # decided off
    assert dispatch.primitive_cache_capacity(32, torch.float32, "tiny", "b") == 32


def test_a_first_start_leaves_room_for_its_own_decision(ext, monkeypatch):
    """Nothing cached (a fresh machine, or a container whose cache folder is new at every start): oneDNN's cache is
    sized for bounded shapes before the build, so the measurement's decision takes effect in this very process."""
    assert dispatch.primitive_cache_capacity(32, torch.float32, "never-measured") == dispatch.PADDED_CACHE_CAPACITY
    monkeypatch.setenv(dispatch.CAPACITY_ENV, str(dispatch.primitive_cache_capacity(32, torch.float32, "fresh")))
    w = weights(ext)
    t = dispatch.tune(w, torch.float32, "fresh", timer=creation_costing(50.0))
    assert t.bounded_shapes and padded_weights(w) == {True}


def test_bounded_shapes_wait_for_a_cache_that_holds_them(ext, monkeypatch, caplog):
    """Decided at a first start, after oneDNN's cache was sized at 32: padding would only add rows, so it starts
    with the next start (which sizes the cache from the cached decision)."""
    monkeypatch.setenv(dispatch.CAPACITY_ENV, "32")
    caplog.set_level(logging.INFO, logger="pagedllm")
    w = weights(ext)
    t = dispatch.tune(w, torch.float32, "tiny", timer=creation_costing(50.0))
    assert t.bounded_shapes and padded_weights(w) == {False} and "from the next start" in caplog.text


@pytest.mark.parametrize("override", ["0", "1"])
def test_pad_rows_overrides_the_decision(ext, monkeypatch, caplog, override):
    """PAGEDLLM_PAD_ROWS=1 pads (and sizes oneDNN's cache) where the measurement says no, =0 the reverse; the table
    still holds what was measured."""
    caplog.set_level(logging.INFO, logger="pagedllm")
    monkeypatch.setenv(dispatch.PAD_ENV, override)
    w = weights(ext)
    t = dispatch.tune(w, torch.float32, "tiny", timer=creation_costing(0.5 if override == "1" else 50.0))
    assert t.bounded_shapes is (override == "0") and padded_weights(w) == {override == "1"}
    assert f"{dispatch.PAD_ENV}={override}" in caplog.text
    assert dispatch.primitive_cache_capacity(32, torch.float32, "tiny") == (dispatch.PADDED_CACHE_CAPACITY
                                                                              if override == "1" else 32)


def test_past_its_budget_the_decision_counts_the_kinds_left_at_the_measured_mean(ext):
    """Both kinds run oneDNN here; with no budget left after the first row count, that one sample stands for both."""
    w, timer = weights(ext, layers=1), FakeTimer({"int8": 3.0, "onednn": 2.0}, fixed={"onednn_cold": 500.0})
    t = dispatch.measure(w, torch.float32, timer)
    timer.calls.clear()
    dispatch.measure_shapes(w, t, torch.float32, timer, budget_s=0.0)
    assert sorted(t.onednn_kinds) == ["o", "qkv"] and sum(p == "onednn_cold" for _, p, _ in timer.calls) == 1
    assert t.miss_s == pytest.approx(2 * 500.0) and t.bounded_shapes
