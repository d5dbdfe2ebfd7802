"""Which kernel runs each matmul, measured where the engine runs (issue 27). Cut-offs tuned by hand on one CPU kind
were wrong on the next, so at the first start on a machine the engine times every form a weight has (the file's
4-bit weights, bf16_gemm, oneDNN's packed matmul, int8 where the flags allow it) on the model's own shapes at a few
row counts, keeps the fastest per row count, and caches the table in the user's cache directory; later starts read it.
PAGEDLLM_KERNEL forces a path (or `static`, the hand-tuned cut-offs) for experiments."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedllm.model import kernel_timing, kernels, machine_cache
from pagedllm.model.kernel_timing import PATHS, Timer, time_call
from pagedllm.model.layers import BIGGEST, PackedWeight, Route, padded_rows

logger = logging.getLogger("pagedllm")

TIE = 0.03  # oneDNN's matmul (no extra copy of the weight; int8 changes numerics) keeps a row count within this
FORCE_ENV = "PAGEDLLM_KERNEL"  # measured (default) | static | one of PATHS
PAD_ENV = "PAGEDLLM_PAD_ROWS"  # 1 / 0: bounded shapes on / off whatever the table decided (measured, the default)
# Part of a table's key: changed when a kernel's speed changes enough that an old table's winners no longer hold, or
# the table's fields change (2: the fp32 int4 kernel, csrc/int4_linear_f32.cpp; 3: the bounded-shapes decision; 4: it
# is timed inside the oneDNN range; 5: each sample on other layers' weights; 6: bf16_gemm and int8_gemm broadcast
# each activation once into a register, 8-25% faster per call on Zen 5: docs/scripts/gemm_kernels_speed.py; 7:
# bf16_gemm prefetches a thread's whole next panel while it computes the current one, 3-24% faster at 16-128 rows in
# Zen 5's table; 8: the int8 lm_head adds its outlier channels' product as it writes the logits, instead of a bf16
# addmm over them afterwards: the greedy logits pass 11% faster at 64 rows, 14% at 256, docs/scripts/logits_pass.py;
# 9: row counts timed coarse to fine, kernel_timing.py: a table cut short by its budget had the wrong crossover; 10:
# the 4-bit weights with fp16 products, int4_f16; 11: the biggest row count's once-over checked against its neighbour
# below, kernel_timing.check_in_line: a cached table had a stalled sample decide every batch past 724 rows; 12: int4_f16
# in bf16 models too; 13: the 4-bit weights against int8 activations, int4_q8).
KERNELS_VERSION = "13"
CAPACITY_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # read by oneDNN once, when it creates its first primitive
ONEDNN_DEFAULT_CAPACITY = 1024  # oneDNN's own, where the variable is not set
PADDED_CACHE_CAPACITY = 512  # oneDNN primitives: every padded row count (~70 per kind, fewer for the lm_head) x 5
# Bounded shapes, measured: a oneDNN matmul at a row count this process never ran (a new primitive: cold) against the
# same call again (warm). Odd counts are neither a bucket nor a padded size; each measurement shifts them by
# FRESH_SHIFT so a later one in the same process (another engine) meets no primitive of an earlier one.
FRESH_ROWS = (23, 45, 91)
FRESH_SHIFT = 2
PAD_BUDGET_S = 0.2  # a row count that would end past this is not timed; kinds left count at the measured ones' mean
_fresh_calls = itertools.count()

@dataclass
class KernelTable:
    """Seconds per call of each path at each row count, per matmul kind; None where a path was not timed."""

    buckets: dict[str, list[int]]
    times: dict[str, dict[str, list[float | None]]]
    key: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # spent measuring
    load: float = 0.0  # the 1-minute load average when measured
    others_cpu: float = 0.0  # the CPUs' worth of time other processes used on ours while it was measured
    # Bounded shapes (PackedWeight.pad_rows, a primitive cache of PADDED_CACHE_CAPACITY): on where re-creating a
    # step's oneDNN primitives (miss_s: cold - warm per oneDNN-routed kind, summed) costs more than padding its rows
    # (pad_s: padded_rows' mean extra rows over a bucket at the warm per-row time, summed likewise).
    bounded_shapes: bool = False
    miss_s: float = 0.0
    pad_s: float = 0.0
    onednn_kinds: list[str] = field(default_factory=list)  # the kinds some of whose row counts oneDNN serves

    def winners(self, kind: str) -> list[str]:
        """The fastest path at each row count (oneDNN on a TIE); where none was timed (one path left, or out of
        budget), the nearest timed row count's winner (the smaller on a tie), or oneDNN. A lone row count between two
        won by another path goes with them."""
        timed_won: dict[int, str] = {}
        for i in range(len(self.buckets[kind])):
            timed = {p: t[i] for p, t in self.times[kind].items() if t[i] is not None}
            if timed:
                best = min(timed, key=timed.__getitem__)
                timed_won[i] = "onednn" if timed.get("onednn", math.inf) <= timed[best] * (1 + TIE) else best
        won = [timed_won[min(timed_won, key=lambda j: (abs(j - i), j))] if timed_won else "onednn"
               for i in range(len(self.buckets[kind]))]
        for i in range(1, len(won) - 1):  # one row count alone between two of another path's: noise, not a range
            won[i] = won[i - 1] if won[i - 1] == won[i + 1] else won[i]
        return won

    def route(self, kind: str) -> Route:
        """The winners as a route: a row count takes its nearest timed one (boundaries at geometric midpoints)."""
        buckets, won = self.buckets[kind], self.winners(kind)
        legs: list[tuple[int, str]] = []
        for i, path in enumerate(won):
            limit = math.isqrt(buckets[i] * buckets[i + 1]) if i + 1 < len(won) else BIGGEST
            if legs and legs[-1][1] == path:
                legs[-1] = (limit, path)
            else:
                legs.append((limit, path))
        return tuple(legs)

    def summary(self) -> str:
        """One line: which path each kind's batches take, by rows."""
        def legs(route: Route) -> str:
            return ", ".join(p if limit == BIGGEST else f"{p} <={limit}" for limit, p in route)
        return "; ".join(f"{kind}: {legs(self.route(kind))}" for kind in self.times)

    def shapes_summary(self) -> str:
        """The bounded-shapes decision and what it rests on."""
        return (f"bounded shapes {'on' if self.bounded_shapes else 'off'} (a new row count's oneDNN primitives "
                f"{self.miss_s * 1e3:.2f} ms a step over {len(self.onednn_kinds)} kinds, padding "
                f"{self.pad_s * 1e3:.2f} ms)")


def pad_override() -> bool | None:
    """PAGEDLLM_PAD_ROWS=1 / 0: bounded shapes on / off whatever was measured; unset (or else): measured."""
    return {"1": True, "0": False}.get(os.environ.get(PAD_ENV, ""))


def capacity_in_force() -> int:
    """oneDNN's primitive cache size as the environment says (the engine sets it before oneDNN's first primitive)."""
    try:
        return int(os.environ.get(CAPACITY_ENV, ONEDNN_DEFAULT_CAPACITY))
    except ValueError:
        return ONEDNN_DEFAULT_CAPACITY


def primitive_cache_capacity(unpadded: int, dtype: torch.dtype, model_name: str, variant: str = "") -> int:
    """oneDNN's primitive cache size, set before oneDNN's first primitive (the model's build, before any measuring):
    room for every bounded shape where PAGEDLLM_PAD_ROWS=1 or this machine's cached table for the model decided
    them, `unpadded` where it decided against. At a first start (no table: a fresh machine, or a container whose
    cache folder does not persist) the room too, so that this process pads if its own measurement decides so."""
    on = pad_override()
    if on is None:
        wanted = prebuild_key(dtype, model_name, variant)
        table = load(machine_cache.cache_file(wanted), wanted)
        on = table is None or table.bounded_shapes
    return PADDED_CACHE_CAPACITY if on else unpadded


@dataclass(frozen=True)
class PlannedForms:
    """One matmul kind in this machine's cached table: the shape and forms it was measured for (PackedWeight.entry)
    and the forms its route takes: a build whose weight has that entry makes only those."""

    entry: str
    taken: frozenset[str]


def planned_forms(dtype: torch.dtype, model_name: str, variant: str = "") -> dict[str, PlannedForms] | None:
    """Each kind's PlannedForms from the table cached for this machine and model, read before the build so that the
    forms no route takes are never made (their time and memory at start-up); None at a first start and where
    PAGEDLLM_KERNEL sets the routes (every form made)."""
    if os.environ.get(FORCE_ENV, "measured") != "measured":
        return None
    key = prebuild_key(dtype, model_name, variant)
    table = load(machine_cache.cache_file(key), key)
    if table is None or "shapes" not in table.key:
        return None
    entries = json.loads(table.key["shapes"])
    return {kind: PlannedForms(entries[kind], frozenset(path for _, path in table.route(kind)))
            for kind in table.times if kind in entries}


def auto_fp32(dtype_flag: str, dtype: torch.dtype) -> bool:
    """`--dtype auto` chose fp32 (no fast bf16 here): the lm_head may run int8 where it is faster, its top candidates
    rescored in fp32 (llama.py), so greedy tokens stay fp32's; an explicit float32 stays exact."""
    return dtype_flag == "auto" and dtype == torch.float32


def prebuild_key(dtype: torch.dtype, model_name: str, variant: str = "") -> dict[str, str]:
    """The part of a table's key known before the model is built: the machine, the kernels' version and sources, the
    model, its dtype and `variant` (the engine flags that choose its weights' forms)."""
    return {**machine_cache.machine_key(), "kernels": KERNELS_VERSION, "build": kernels.source_digest(),
            "model": model_name, "dtype": str(dtype).removeprefix("torch."), "variant": variant,
            "buckets": repr(kernel_timing.BUCKETS)}


def table_key(weights: dict[str, list[PackedWeight]], dtype: torch.dtype, model_name: str,
              variant: str = "") -> dict[str, str]:
    """What a table holds for: prebuild_key and each kind's shape and forms."""
    shapes = {kind: ws[0].entry() for kind, ws in weights.items()}
    return {**prebuild_key(dtype, model_name, variant), "shapes": json.dumps(shapes, sort_keys=True)}


def cacheable(table: KernelTable) -> bool:
    return machine_cache.quiet(table.load, table.others_cpu)


def measure(weights: dict[str, list[PackedWeight]], dtype: torch.dtype, timer: Timer = time_call,
            budget_s: float | None = None) -> KernelTable:
    """Every kind's paths timed on its own weights (kernel_timing.measure_paths), as a table."""
    buckets, times, seconds = kernel_timing.measure_paths(weights, dtype, timer, budget_s)
    return KernelTable(buckets, times, seconds=seconds)


def mean_padding(rows: int) -> float:
    """The rows padded_rows adds on average over the bucket (power-of-two range) that holds `rows`."""
    low = 1 << (rows.bit_length() - 1)
    return sum(padded_rows(r) - r for r in range(low, 2 * low)) / low


def measure_shapes(weights: dict[str, list[PackedWeight]], table: KernelTable, dtype: torch.dtype,
                   timer: Timer = time_call, budget_s: float = PAD_BUDGET_S) -> None:
    """Decide bounded shapes into `table`: on each kind its route sends to oneDNN (smallest weight first), a matmul
    at FRESH_ROWS row counts of its oneDNN range (`fresh_rows`) new to this process (cold: a primitive created) and
    the same call again (warm). A step at a new row count re-creates one primitive per such kind (miss_s); padding
    costs every step mean_padding's rows at the warm per-row time (pad_s). Past `budget_s` nothing more is timed:
    the kinds left count at the mean."""
    kinds = [k for k in table.times if any(p == "onednn" for _, p in table.route(k))]
    shift = FRESH_SHIFT * next(_fresh_calls) % 64
    start = time.perf_counter()
    samples: dict[str, list[tuple[float, float]]] = {}  # per kind, (miss, pad) at each row count timed
    for kind in sorted(kinds, key=lambda k: math.prod(weights[k][0].shape)):
        weight = weights[kind][0]
        for i, rows in enumerate(r + shift for r in fresh_rows(table.route(kind))):
            if samples and time.perf_counter() - start + fresh_cost(table, kind, rows) > budget_s:
                break
            if i == 0:  # its weight brought as near as a warm call finds it
                weight.mm(torch.randn(1, weight.shape[1]).to(dtype), path="onednn")
            samples.setdefault(kind, []).append(time_fresh(weight, kind, rows, dtype, timer))
    misses = [statistics.median(m for m, _ in s) for s in samples.values()]
    pads = [statistics.median(p for _, p in s) for s in samples.values()]
    table.onednn_kinds = kinds
    table.miss_s = round(statistics.fmean(misses) * len(kinds), 6) if misses else 0.0
    table.pad_s = round(statistics.fmean(pads) * len(kinds), 6) if pads else 0.0
    table.bounded_shapes = table.miss_s > table.pad_s
    table.seconds = round(table.seconds + time.perf_counter() - start, 3)


def fresh_rows(route: Route) -> tuple[int, ...]:
    """FRESH_ROWS inside the route's first oneDNN leg (above the rows a faster kernel takes: a primitive's cost and
    padding's are what they are where oneDNN runs, e.g. 385 / 407 / 453 rows where the 4-bit kernel takes 362)."""
    start = 0
    for limit, path in route:
        if path == "onednn":
            return tuple(min((start & ~1) + r, limit) for r in FRESH_ROWS)  # odd: no padded size
        start = limit
    return FRESH_ROWS


def fresh_cost(table: KernelTable, kind: str, rows: int) -> float:
    """What time_fresh's three calls at `rows` should take, by the table's oneDNN time at the nearest row count timed
    (in proportion to the rows); 0 where none was: the lm_head's fresh row counts took 0.1-0.15 s each on Zen 3, and
    a budget checked only before each overran its 0.25 s by half."""
    timed = [(b, t) for b, t in zip(table.buckets[kind], table.times[kind].get("onednn", ())) if t is not None]
    if not timed:
        return 0.0
    near, seconds = min(timed, key=lambda bt: abs(math.log(bt[0] / rows)))
    return 3 * seconds * rows / near


def time_fresh(weight: PackedWeight, kind: str, rows: int, dtype: torch.dtype, timer: Timer) -> tuple[float, float]:
    """At a row count new to this process: what its new primitive costs (cold - warm, the warm the faster of two)
    and what padding costs there (mean_padding's rows at the warm per-row time)."""
    run = functools.partial(weight.mm, torch.randn(rows, weight.shape[1]).to(dtype), path="onednn")
    cold = timer(kind, "onednn_cold", rows, run)
    warm = min(timer(kind, "onednn", rows, run) for _ in range(2))
    return max(cold - warm, 0.0), mean_padding(rows) * warm / rows


def bounded_shapes(table: KernelTable | None) -> tuple[bool, str]:
    """Whether this process pads oneDNN's rows, and why: PAGEDLLM_PAD_ROWS, else the table's decision where oneDNN's
    cache (sized before the decision, at its first primitive) holds every padded shape; else off."""
    override = pad_override()
    if override is not None:
        why = f"bounded shapes {'on' if override else 'off'} ({PAD_ENV}={os.environ[PAD_ENV]})"
        return override, why if table is None else f"{why}; measured: {table.shapes_summary()}"
    if table is None:
        return False, "bounded shapes off"
    if table.bounded_shapes and capacity_in_force() < PADDED_CACHE_CAPACITY:
        return False, (f"{table.shapes_summary()}, from the next start: oneDNN's cache holds {capacity_in_force()} "
                       f"primitives in this process")
    return table.bounded_shapes, table.shapes_summary()


def apply(table: KernelTable, weights: dict[str, list[PackedWeight]]) -> None:
    """Route every weight by its kind's winners and drop the forms no route takes."""
    for kind, ws in weights.items():
        route = table.route(kind)
        for w in ws:
            w.route = route
            w.keep_only(frozenset(p for _, p in route))


def fits(table: KernelTable, weights: dict[str, list[PackedWeight]]) -> bool:
    """Every weight has each form its kind's route takes (a planned build made only those of the table it read)."""
    return all(frozenset(p for _, p in table.route(kind)) <= w.paths() for kind, ws in weights.items() for w in ws)


def force(path: str, weights: dict[str, list[PackedWeight]]) -> None:
    """Every batch of every weight that has `path`'s form takes it; the others keep their static route."""
    for ws in weights.values():
        for w in ws:
            if path in w.paths():
                w.route = ((BIGGEST, path),)


def load(path: Path, key: dict[str, str]) -> KernelTable | None:
    """The table cached at `path` if it was measured for `key` (or, a key without "shapes": for its part known before
    the build)."""
    data = machine_cache.load_json(path, key, ignore=() if "shapes" in key else ("shapes",))
    try:
        return None if data is None else KernelTable(**data)
    except TypeError:
        return None


def save(path: Path, table: KernelTable) -> None:
    machine_cache.save_json(path, asdict(table))


def set_padding(weights: dict[str, list[PackedWeight]], padded: bool) -> None:
    for weight in (w for kind in weights.values() for w in kind):
        weight.pad_rows = padded  # each weight's own flag: nothing process-wide is replaced


def tune(weights: dict[str, list[PackedWeight]], dtype: torch.dtype, model_name: str, refresh: bool = False,
         timer: Timer = time_call, variant: str = "") -> KernelTable | None:
    """Set every weight's route and bounded shapes: the cached table for this machine and model, else a fresh
    measurement (cached); PAGEDLLM_KERNEL=static keeps the hand-tuned routes, =PATH forces one. Logs which path
    each kind's batches take, and whether oneDNN's rows are padded."""
    set_padding(weights, False)  # measured unpadded: a padded fresh row count would meet an older primitive
    forced = os.environ.get(FORCE_ENV, "measured")
    if forced not in ("measured", "static", *PATHS):
        raise ValueError(f"{FORCE_ENV} must be measured, static or one of {', '.join(PATHS)}, got {forced!r}")
    if forced != "measured" or not weights:
        if forced in PATHS:
            force(forced, weights)
        padded, shapes = bounded_shapes(None)
        set_padding(weights, padded)
        logger.info("kernels: %s=%s, not measured; %s", FORCE_ENV, forced, shapes)
        return None
    key = table_key(weights, dtype, model_name, variant)
    file = machine_cache.cache_file(key)
    table = None if refresh else load(file, key)
    how = f"read from {file}"
    if table is None and not refresh:
        table = machine_cache.unsaved(key, KernelTable)
        how = how if table is None else "measured earlier in this process while other processes held the cores"
    if table is None and any(w.skipped for ws in weights.values() for w in ws):
        # built for the table on disk, which another process replaced since: its routes are the ones the forms fit
        table = load(file, machine_cache.prebuild_part(key))
        how = f"read from {file} (as the build planned)"
        if table is None:
            raise RuntimeError(f"{file}: the kernel table this model was built for is gone; start again to measure")
        if not fits(table, weights):
            raise RuntimeError(f"{file}: the kernel table was replaced since this model's build, its routes taking "
                               f"forms the build did not make; start again")
    if table is None:
        start = machine_cache.cpu_sample()
        with torch.inference_mode():
            table = measure(weights, dtype, timer)
            measure_shapes(weights, table, dtype, timer)
        others = round(machine_cache.others_since(start), 2)
        table.key, table.load, table.others_cpu = key, machine_cache.machine_load(), others
        how = f"measured in {table.seconds:.1f} s, cached at {file}"
        if not cacheable(table):
            how = (f"measured in {table.seconds:.1f} s at load {table.load:.1f} while other processes used "
                   f"{table.others_cpu:.2f} CPUs, not cached: measured again next start")
            machine_cache.keep_unsaved(key, table)
        else:
            save(file, table)
    apply(table, weights)
    padded, shapes = bounded_shapes(table)
    set_padding(weights, padded)
    logger.info("kernels (%s): %s; %s", how, table.summary(), shapes)
    return table
