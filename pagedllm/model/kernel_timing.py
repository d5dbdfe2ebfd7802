"""Timing each matmul kind's kernel paths at row counts, coarse to fine, within a first start's budget: what the
measured dispatch (model/dispatch.py) reads its winners from."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch

from pagedllm.model.layers import PackedWeight

# int8: csrc/int8_gemm.cpp (VNNI or AVX2); int8_mm: oneDNN's; bf16_plain: torch's bf16 matmul where oneDNN has none;
# int4_f16: the 4-bit weights with fp16 products (AVX512-FP16; fp32 models from `--dtype auto`, and bf16 ones); int4_q8:
# against int8 activations (AVX512-VNNI and VBMI, or AVX2; fp32 models from `--dtype auto` only)
PATHS = ("int4", "bf16_gemm", "onednn", "int8", "int8_mm", "bf16_plain", "int4_f16", "int4_q8")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # row counts timed; a step takes its nearest one (log scale)
# The lm_head runs on the sampled rows only, one per sequence (max_num_seqs 256). Its biggest timed row count is 128:
# 129-256 take that one's winner. At 64, 128 and 256 rows every table measured had one winner (the Intel Xeon without
# BF16, Zen 5 at 135M and 1B, Zen 3), its time in proportion to the rows; timing 256 took a quarter of the budget here.
LM_HEAD_BUCKETS = BUCKETS[:8]
SAMPLES = 3  # timed calls per path and row count, interleaved across paths, after one warm-up; the fastest counts
# Up to COLD_MAX_ROWS rows a call is timed over COLD_WEIGHTS layers' weights of its kind in turn, other layers at each
# sample, as a step reads them (from memory, not from the cache a repeated call leaves one in: bf16_gemm's gain over
# oneDNN at 64 rows was in those first reads, docs/scripts/linear_cold_weights.py; on a 32 MB cache, 8 layers read
# again hid the 4-bit form's lead at 1-8 rows, docs/scripts/step_order_paths.py); beyond, where the arithmetic
# dominates, on one.
COLD_MAX_ROWS = 256
COLD_WEIGHTS = 8
PRUNE = 2.0  # a path this much slower than oneDNN, and falling further behind, is not timed at bigger row counts
# Paths timed only up to a row count: torch's bf16 matmul where oneDNN has none (emulated, on AVX2) wins at 1-2 rows
# by reading half the bytes, is 6x behind at 64, and its 0.1-1.4 s calls at the biggest spent a first start's budget
# (AMD EPYC Zen 3, docs/performance.md).
MAX_ROWS = {"bf16_plain": 64}
# The first start's measuring stops here, the biggest row count's once-over (ANCHOR_SAMPLES) included. With the
# bounded-shapes decision (0.2 s) and the attention route's (0.6 s, past which its last count still ends) a first
# start measures for about 2.6 s (2.4-2.55 s on Zen 3): the aim is 3 s. (2.5 s until 2026-11-30, when long
# warm-ups were not yet kept: LONG_CALL_S.)
BUDGET_S = 1.8
ANCHOR_SAMPLES = 1  # so that a spent budget costs the table resolution, not its big batches' winner
# A warm-up call at least this long is kept as one of its path's samples (where more than one is taken, one call
# fewer): what it pays once (a new oneDNN primitive, 0.6-2 ms a kind on Zen 3: the bounded-shapes decision's figures)
# is within 4% of it.
LONG_CALL_S = 0.05

# One timed call: (kind, path, rows, run) -> seconds. Tests pass fake timings.
Timer = Callable[[str, str, int, Callable[[], object]], float]
PathTimes = dict[str, list[float | None]]  # per path: seconds per call at each row count (None: not timed)
Times = dict[str, PathTimes]  # per kind


def time_call(kind: str, path: str, rows: int, run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _run(weights: list[PackedWeight], x: torch.Tensor, path: str, out: torch.Tensor | None) -> None:
    for w in weights:
        w.mm(x, path=path, out=out)


def measure_paths(weights: dict[str, list[PackedWeight]], dtype: torch.dtype, timer: Timer = time_call,
                  budget_s: float | None = None) -> tuple[dict[str, list[int]], Times, float]:
    """Time every kind's paths on its own weights, coarse to fine (next_bucket): 1 row, the biggest row count (once:
    ANCHOR_SAMPLES), then midway between timed row counts whose winners differ. A spent budget then costs the table
    its resolution, not the crossover from the small-batch kernels to the big ones: small row counts first spent a 1B
    model's 2.5 s on 1-2 rows, and its 4-bit kernel took every batch up to 45 rows, 1.8x slower there than a GEMM.
    Each row count must fit the budget as projected from the times so far (over_budget); with budget left at the
    end, the biggest gets its full samples. A kind with one path is not timed. A row count whose times do not fit
    the nearest timed one below (a neighbour's load, not the kernel) is timed again, with that one; each keeps its
    fastest. Returns each kind's row counts, the seconds per call of each path at each (None: not timed) and the
    seconds spent."""
    start, budget_s = time.perf_counter(), BUDGET_S if budget_s is None else budget_s
    buckets = {kind: list(LM_HEAD_BUCKETS if kind == "lm_head" else BUCKETS) for kind in weights}
    times = {kind: {p: [None] * len(buckets[kind]) for p in PATHS if p in ws[0].paths()}
             for kind, ws in weights.items()}
    kinds = [kind for kind, paths in times.items() if len(paths) > 1]

    def left() -> float:
        return budget_s - (time.perf_counter() - start)

    def done() -> tuple[dict[str, list[int]], Times, float]:
        return buckets, times, round(time.perf_counter() - start, 3)

    while todo := [(kind, i) for kind in kinds if (i := next_bucket(times[kind])) is not None]:
        for kind, i in todo:
            samples = ANCHOR_SAMPLES if i == len(buckets[kind]) - 1 else SAMPLES
            if over_budget(weights, buckets, times, kind, i, samples + 1, left()):
                anchor_biggest(weights, buckets, dtype, timer, times)
                for other in kinds:
                    check_in_line(weights[other], other, buckets[other], len(buckets[other]) - 1, dtype, timer,
                                  times[other])
                return done()
            time_bucket(weights[kind], kind, buckets[kind], i, compared(times[kind], i), dtype, timer, times[kind],
                        samples)
            check_in_line(weights[kind], kind, buckets[kind], i, dtype, timer, times[kind])
    for kind in kinds:  # the biggest row count's other samples, where the budget still holds them
        last, more = len(buckets[kind]) - 1, SAMPLES - ANCHOR_SAMPLES
        paths = compared(times[kind], last)
        if len(paths) > 1 and projected(weights[kind], buckets[kind], last, paths, times[kind], more) < left():
            time_bucket(weights[kind], kind, buckets[kind], last, paths, dtype, timer, times[kind], more, warm=False)
        check_in_line(weights[kind], kind, buckets[kind], last, dtype, timer, times[kind])
    return done()


def check_in_line(weights: list[PackedWeight], kind: str, buckets: list[int], i: int, dtype: torch.dtype,
                  timer: Timer, times: PathTimes) -> None:
    """Row count i against the nearest timed one below: out of line (plausible), both are timed again and keep their
    fastest. Also the biggest's once-over at the end, past the budget: timed second, it was checked only against 1 row,
    and one stalled sample there (the fp16 kernel's 15.0 ms at 1,024 rows against its 6.7, Intel Xeon, a cached
    table) gave every batch past the last crossover to a kernel 1.7x slower."""
    below = nearest_below(times, i)
    if below is None or times["onednn"][i] is None or plausible(times, buckets, below, i):
        return
    for j in (below, i):
        time_bucket(weights, kind, buckets, j, compared(times, j), dtype, timer, times,
                    ANCHOR_SAMPLES if j == len(buckets) - 1 else SAMPLES)


def next_bucket(times: PathTimes) -> int | None:
    """The row count to time next: 1 row, the biggest, then midway in the widest gap between timed row counts whose
    winners differ, then in the widest gap left; None once each is timed or has one path left to compare."""
    n = len(times["onednn"])
    timed = [i for i in range(n) if times["onednn"][i] is not None]
    open_ = [i for i in range(n) if times["onednn"][i] is None and len(compared(times, i)) > 1]
    ends = [i for i in (0, n - 1) if i in open_]
    if ends or not open_:
        return ends[0] if ends else None
    edges = [-1, *timed, n]
    gaps = [(a, b) for a, b in zip(edges, edges[1:]) if any(a < i < b for i in open_)]

    def differs(gap: tuple[int, int]) -> bool:
        return 0 <= gap[0] and gap[1] < n and fastest(times, gap[0]) != fastest(times, gap[1])
    a, b = max(gaps, key=lambda gap: (differs(gap), gap[1] - gap[0], -gap[0]))
    return min((i for i in open_ if a < i < b), key=lambda i: (abs(2 * i - a - b), i))


def fastest(times: PathTimes, i: int) -> str:
    timed = {p: t[i] for p, t in times.items() if t[i] is not None}
    return min(timed, key=timed.__getitem__)


def nearest_below(times: PathTimes, i: int) -> int | None:
    """The nearest timed row count below i (oneDNN is timed at every timed one)."""
    return next((j for j in range(i - 1, -1, -1) if times["onednn"][j] is not None), None)


def compared(times: PathTimes, i: int) -> list[str]:
    """The paths still timed at row count i (BUCKETS[i] rows: the lm_head's are their prefix): all but those past
    their MAX_ROWS or that fell behind oneDNN at a smaller one."""
    return [p for p in times if BUCKETS[i] <= MAX_ROWS.get(p, math.inf)
            and not any(falling_behind(times, p, j) for j in range(i))]


def projected(weights: list[PackedWeight], rows: list[int], i: int, paths: list[str], times: PathTimes,
              calls: int) -> float:
    """What `calls` calls of each of `paths` at rows[i] would take: by its own times where it was timed, else each
    path's on the line through its nearest timed row counts either side of i (the two below, past the last; flat
    from one); 0 before any was timed."""
    timed = [j for j in range(len(rows)) if all(times[p][j] is not None for p in paths)]
    below, above = [j for j in timed if j < i], [j for j in timed if j > i]
    if i in timed:
        pair = [i]
    elif below and above:
        pair = [below[-1], above[0]]
    else:
        pair = below[-2:] or above[:1]
    if not pair:
        return 0.0
    group = len(weights[:COLD_WEIGHTS if rows[i] <= COLD_MAX_ROWS else 1])
    total = 0.0
    for p in paths:
        first = times[p][pair[0]]
        slope = 0.0 if len(pair) < 2 else max(0.0, (times[p][pair[1]] - first) / (rows[pair[1]] - rows[pair[0]]))
        total += calls * group * (first + slope * (rows[i] - rows[pair[0]]))
    return total


def over_budget(weights: dict[str, list[PackedWeight]], buckets: dict[str, list[int]],
                times: Times, kind: str, i: int, calls: int, left_s: float) -> bool:
    """Whether `calls` calls a path for `kind` at row count i, and then every kind's biggest not yet timed
    (anchor_biggest), would pass `left_s`."""
    cost = projected(weights[kind], buckets[kind], i, compared(times[kind], i), times[kind], calls)
    for other, paths in times.items():
        last = len(buckets[other]) - 1
        if anchor_due(paths, last) and (other, last) != (kind, i):
            cost += projected(weights[other], buckets[other], last, compared(paths, last), paths, ANCHOR_SAMPLES + 1)
    return cost > left_s


def anchor_due(times: PathTimes, last: int) -> bool:
    """The biggest row count is not timed yet and still has paths to compare."""
    return times["onednn"][last] is None and len(compared(times, last)) > 1


def anchor_biggest(weights: dict[str, list[PackedWeight]], buckets: dict[str, list[int]], dtype: torch.dtype,
                   timer: Timer, times: Times) -> None:
    """Out of budget: each kind's biggest row count, if untimed, once per path still compared. Without it the last
    small row count's winner took every bigger batch (a small-batch kernel where, on AMX, oneDNN's tiles win)."""
    for kind, paths in times.items():
        last = len(buckets[kind]) - 1
        if anchor_due(paths, last):
            time_bucket(weights[kind], kind, buckets[kind], last, compared(paths, last), dtype, timer, paths,
                        ANCHOR_SAMPLES)


def time_bucket(weights: list[PackedWeight], kind: str, buckets: list[int], i: int, paths: list[str],
                dtype: torch.dtype, timer: Timer, times: PathTimes,
                samples_per_path: int = SAMPLES, warm: bool = True) -> None:
    """Time `paths` at row count buckets[i], interleaved, one warm-up (unless `warm` is False: timed before; or the
    warm-ups were long: LONG_CALL_S) then the samples; keep each one's fastest."""
    rows = buckets[i]
    groups = sample_groups(weights, rows, samples_per_path + warm)
    x = torch.randn(rows, weights[0].shape[1]).to(dtype)
    # The lm_head's int8 paths write the greedy logits pass's kept buffer (LlamaModel._scratch_logits): a fresh
    # output faulted its pages in at each new row count, and in the one sample taken at the biggest (128) int8 took
    # 16.6 ms against oneDNN int8's 13.3, 12-13 in a step: int8_mm took 91-256 rows, where int8 is 1.4-1.8x faster
    # (AMD EPYC Zen 4, docs/performance.md).
    out = x.new_empty(rows, weights[0].shape[0]) if kind == "lm_head" else None
    samples: dict[str, list[float]] = {p: [] for p in paths}
    long_warm = False  # every warm-up call at least LONG_CALL_S: each is a sample
    for n, group in enumerate(groups):
        if long_warm and samples_per_path > 1 and n == len(groups) - 1:
            break  # one call fewer: a single sample stays two calls (one call's time swung by 1.6x on Zen 3)
        for p in paths:
            samples[p].append(timer(kind, p, rows, functools.partial(_run, group, x, p, out)) / len(group))
        long_warm = long_warm or (n == 0 and warm and all(s[0] * len(group) >= LONG_CALL_S for s in samples.values()))
    skip = int(warm and not long_warm)
    for p, s in samples.items():
        best = min(s[skip:])
        times[p][i] = best if times[p][i] is None else min(times[p][i], best)


def sample_groups(weights: list[PackedWeight], rows: int, count: int) -> list[list[PackedWeight]]:
    """The weights each of `count` samples runs on: up to COLD_MAX_ROWS, COLD_WEIGHTS layers, the next ones at each
    sample (wrapping), so no sample finds its weights where an earlier one of the same path left them; beyond, one."""
    if rows > COLD_MAX_ROWS:
        return [weights[:1]] * count
    n = min(COLD_WEIGHTS, len(weights))
    return [[weights[(s * n + j) % len(weights)] for j in range(n)] for s in range(count)]


def plausible(times: PathTimes, buckets: list[int], below: int, i: int) -> bool:
    """More rows never take much less time, nor more than 1.5x in proportion (against the timed row count below)."""
    grow = buckets[i] / buckets[below]
    return all(t[below] is None or t[i] is None or 2 / 3 <= t[i] / t[below] <= 1.5 * grow for t in times.values())


def falling_behind(times: PathTimes, path: str, i: int) -> bool:
    """Over PRUNE x oneDNN (the fallback, which always stays) at row count i and further behind it than at the
    nearest row count below where both were timed: a small-batch kernel past its range (int8's fixed costs shrink
    with rows instead, so it stays). Not the winner's: at 1-4 rows, reading a third of the bytes, the 4-bit kernel is
    2.3x faster than bf16_gemm, which from 16 rows wins."""
    def ratio(j: int) -> float:
        mine, fallback = times[path][j], times["onednn"][j]
        return mine / fallback if mine is not None and fallback is not None else math.inf
    below = next((j for j in range(i - 1, -1, -1) if ratio(j) < math.inf), None)
    return path != "onednn" and below is not None and ratio(i) < math.inf and ratio(i) > PRUNE \
        and ratio(i) > ratio(below)


