"""Which attention kernel each sequence takes, measured where the engine runs (issue 27's measured dispatch, for
attention). The row (decode) kernel and the tiled (prefill) kernel cross over at a query-row count set by hand on one
CPU kind (20 rows, an Intel Xeon without AVX512-BF16); on an AMD EPYC Zen 5 the row kernel stayed the faster up to
48 rows in a busy step (the tiled one from 96), and the tiled kernel's bf16 form (vdpbf16ps) was chosen by ISA
alone. So at the first start on a machine the engine times both kernels on the model's own attention shape at a few
query counts, in a busy step (every sequence its own task) and in steps of few sequences (fewer than 4 per thread: a
run's tail, where drafts are verified a few queries at a time), and the tiled kernel's two forms on a prompt where both
exist (bf16 queries: vdpbf16ps or fp32; fp32 queries where `--dtype auto` chose fp32: fp16 products or fp32), and for
bf16 prompt chunks the tiled kernel against torch's flash attention (AMX tiles where the CPU has them,
model/attention_sdpa.py); the route is cached beside the kernel table (model/machine_cache.py).
PAGEDLLM_ATTENTION=static keeps the hand-set route, for experiments."""

from __future__ import annotations

import bisect
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType

import torch

from pagedllm.model import kernels, machine_cache
from pagedllm.model.attention import (
    STATIC_ROUTE,
    AttentionRoute,
    cpp_attention,
    kv_record_len,
    quantize_kv,
    unsupported_reason,
)
from pagedllm.model.loader import ModelConfig

logger = logging.getLogger("pagedllm")

# Part of a table's key: changed when a kernel's speed changes enough that an old route no longer holds, or the table's
# fields change.
# 2: steps of few sequences timed as a mix of 1 to 4T-1 sequences, not one of 512 tokens; 3: each kind of step
# bisected between its ends, the two kinds in turn (the few-sequence steps' counts first had spent the budget on Zen 3,
# and busy steps then took the hand-set route, or a guess from 1-2 counts); 4: bf16 prompt chunks timed on torch's
# flash attention too
ATTENTION_VERSION = "4"
FORCE_ENV = "PAGEDLLM_ATTENTION"  # measured (default) | static
# Queries per sequence timed; rows = queries x query heads per kv head. Every count to 4 and 6: a verification of k
# drafts has k + 1 queries (4 by default), and between timed counts the boundary is only guessed.
QUERY_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
BUSY_SEQS_PER_THREAD = 8  # a busy step: more sequences than the kernel's 4 per thread, so none is split
BUSY_CONTEXTS = (100, 1000)  # each sequence's context, drawn from this range (seeded), in both kinds of step
# Steps of few sequences (fewer than 4 per thread), timed together (the sum counts): 1, 2T and 4T-1 sequences on T
# threads. A step of one 512-token sequence alone put the boundary at 9 rows on a Zen 5, where the 200 requests then
# ran 4% slower than with the hand-set 20 rows; over this mix it lands at 59-118 rows there (step_contexts).
PROMPT = 512  # the tiled kernel's two forms compared on one prompt of this many tokens
# A step's budget of prompt tokens in fresh prompts of this many each, on the tiled kernel and on torch's flash
# attention (bf16 only). On an Intel Xeon with AMX one prompt alone took flash attention from ~90 tokens, but a step of
# several short prompts ran slower on it (ten of 100 tokens 1.35 ms against 0.83, one call each), and the 200
# ShareGPT-like requests 2-5% slower; one of 1,024 tokens 2.6 ms against 4.3.
CHUNK_QUERIES = (128, 256, 512, 1024)
CHUNK_STEP = 1024  # the engine's default step budget
# Flash attention must win by this much: its calls run apart from the step's other sequences, whose kernel call then
# has no prompt tiles to fill its threads' idle tails (three prompts of 300 tokens and 100 decodes: 3.5 ms against
# 3.1 in one C++ call, where the prompts alone tied).
CHUNK_MARGIN = 0.15
SAMPLES = 3  # timed calls per kernel and query count, interleaved, after one warm-up; the fastest counts
MIN_LAYERS = 2  # a step's keys and values copied to fill cold_bytes() (at least this many copies)
TIE = 0.03  # the fp32 tile form (exact sums of fp32 products) keeps a tie within this
# Measuring stops at the next query count past this; the counts timed decide. Both regimes bisected to the end took
# 0.74-0.80 s on Zen 3 (fp32 queries, where the row kernel wins up to 72-96 rows): 0.6 s leaves one count out there.
BUDGET_S = 0.6
REGIMES = ("busy", "few")
REGIME_TEXT = {"busy": f"{BUSY_SEQS_PER_THREAD} sequences per thread, contexts of "
                       f"{BUSY_CONTEXTS[0]}-{BUSY_CONTEXTS[1]} tokens",
               "few": f"1, 2T and 4T-1 sequences on T threads, timed together, contexts of "
                      f"{BUSY_CONTEXTS[0]}-{BUSY_CONTEXTS[1]} tokens"}

# One timed call: (what, kernel, rows, run) -> seconds. Tests pass fake timings.
Timer = Callable[[str, str, int, Callable[[], object]], float]


@dataclass(frozen=True)
class AttentionShape:
    """What the choice depends on besides the machine: the model's heads and dtypes, the cache's dtype and blocks."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the queries' (the model's)
    kv_dtype: torch.dtype  # the cache's: the model's, or uint8 for int8 records
    block_size: int
    f16: bool = False  # fp16 products allowed (`--dtype auto` chose fp32): fp32 tiles over a bf16 cache may take them

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int,
           f16: bool = False) -> AttentionShape:
        return cls(config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype, kv_dtype, block_size,
                   f16)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def key(self) -> dict[str, str]:
        return {**machine_cache.machine_key(), "attention": ATTENTION_VERSION, "build": kernels.source_digest(),
                "heads": f"{self.heads}/{self.kv_heads}x{self.head_dim}", "block_size": str(self.block_size),
                "dtype": str(self.dtype).removeprefix("torch."), "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
                **({"f16": "allowed"} if self.f16 else {})}

    def tile_forms(self, ext: ModuleType) -> tuple[str, str] | None:
        """The tiled kernel's two forms timed against each other here, the cheaper arithmetic's first; None where
        only the fp32 one runs this shape."""
        if self.dtype == self.kv_dtype == torch.bfloat16 and ext.tile_pairs_supported():
            return "pairs", "fp32"
        if self.f16 and self.dtype == torch.float32 and self.kv_dtype == torch.bfloat16 and ext.tile_f16_supported():
            return "f16", "fp32"
        return None


@dataclass
class AttentionTable:
    """Seconds per call of each kernel at each timed row count, per regime; the tile forms' on a prompt."""

    rows: dict[str, list[int]]  # per regime: the query rows timed, ascending
    times: dict[str, dict[str, list[float]]]  # per regime, per kernel ("rows", "tile"): seconds per call
    tile_forms: dict[str, float] = field(default_factory=dict)  # "pairs" or "f16", and "fp32": where both exist
    # bf16 steps: "tile" and "sdpa" at the longest len(...) of CHUNK_QUERIES, ascending
    chunks: dict[str, list[float]] = field(default_factory=dict)
    top_rows: int = 0  # the most query rows a regime's timing would reach (QUERY_COUNTS[-1] x the query group)
    key: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    load: float = 0.0
    others_cpu: float = 0.0

    def route(self) -> AttentionRoute:
        busy, few = (self.boundary(r, static) for r, static in zip(REGIMES, (STATIC_ROUTE.tile_min_rows,
                                                                             STATIC_ROUTE.few_tile_min_rows)))
        return AttentionRoute(busy, few, "pairs" not in self.tile_forms or self.faster("pairs"), self.faster("f16"),
                              self.sdpa_min_queries())

    def sdpa_min_queries(self) -> int:
        """Chunks from this many queries take flash attention: where it is never slower from a timed count on (the
        boundary at the geometric midpoint below it, never below the fewest timed); 0 where it never won or was not
        timed."""
        if not self.chunks:
            return 0
        queries = self.chunk_queries()
        flash = [t * (1 + CHUNK_MARGIN) for t in self.chunks["sdpa"]]  # its times with the margin it must beat
        bound = crossover(queries, {"rows": self.chunks["tile"], "tile": flash})
        return 0 if bound > queries[-1] else max(bound, CHUNK_QUERIES[0])

    def chunk_queries(self) -> list[int]:
        """The prompt lengths `chunks` holds times for: the longest of CHUNK_QUERIES (time_chunks stops going down)."""
        return list(CHUNK_QUERIES[len(CHUNK_QUERIES) - len(self.chunks.get("tile", [])):])

    def faster(self, form: str) -> bool:
        """Whether the tile form was timed and beat the fp32 form by more than TIE."""
        return form in self.tile_forms and self.tile_forms[form] * (1 + TIE) < self.tile_forms["fp32"]

    def boundary(self, regime: str, static: int) -> int:
        """The regime's crossover; where the budget ran out before its biggest count and the row kernel won the last
        one timed, that is a lower bound only: the hand-set boundary if it is higher; nothing timed, the hand-set."""
        rows = self.rows.get(regime)
        if not rows:
            return static
        bound = crossover(rows, self.times[regime])
        return max(bound, static) if bound == rows[-1] + 1 and rows[-1] < self.top_rows else bound

    def summary(self) -> str:
        route = self.route()
        forms = ""
        if self.tile_forms:
            taken = (f"bf16 queries (tiles, decode) {'on vdpbf16ps' if route.tile_pairs else 'in fp32'}"
                     if "pairs" in self.tile_forms
                     else f"fp32 tiles {'with fp16 products' if route.tile_f16 else 'in fp32'}")
            forms = (f"; {taken} (a {PROMPT}-token prompt "
                     + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.tile_forms.items()) + ")")
        chunks = ""
        if self.chunks:
            chunks = (f"; bf16 chunks from {route.sdpa_min_queries} queries on torch's flash attention"
                      if route.sdpa_min_queries else "; no chunk on torch's flash attention")
        return (f"tiled kernel from {route.tile_min_rows} query rows in busy steps, from "
                f"{route.few_tile_min_rows} in steps of few sequences{forms}{chunks}")


def crossover(rows: list[int], times: dict[str, list[float]]) -> int:
    """The fewest query rows that take the tiled kernel: from the first timed count from which it is never slower
    (the boundary at the geometric midpoint below it); past the last timed count where the row kernel still won."""
    start = len(rows)
    while start > 0 and times["tile"][start - 1] <= times["rows"][start - 1]:
        start -= 1
    if start == 0:
        return 1
    if start == len(rows):
        return rows[-1] + 1
    return math.isqrt(rows[start - 1] * rows[start]) + 1


def time_call(what: str, kernel: str, rows: int, run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@dataclass
class _Step:
    """One timed step's inputs: the sequences' contexts (blocks in random order) in `layers` copies, one pool, so
    that no call finds its keys in the cache where the one before left them (a step reads them from memory), and
    their queries."""

    shape: AttentionShape
    pools: tuple[torch.Tensor, torch.Tensor]  # K and V, [layers * blocks, block_size, kv_heads, row]
    tables: list[torch.Tensor]  # per layer
    lens: torch.Tensor

    @classmethod
    def build(cls, shape: AttentionShape, lens: list[int], gen: torch.Generator, layers: int | None = None) -> _Step:
        """`layers` copies (default: as many as fill cold_bytes() alone)."""
        bs = shape.block_size
        blocks = [math.ceil(n / bs) for n in lens]
        order = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
        tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        taken = 0
        for s, b in enumerate(blocks):
            tables[s, :b] = order[taken:taken + b]
            taken += b
        one = _cache(shape, sum(blocks), gen)
        layers = layers or layer_copies(shape, [lens])
        pools = tuple(one.repeat(layers, 1, 1, 1) for _ in range(2))
        return cls(shape, pools, [tables + i * sum(blocks) for i in range(layers)],
                   torch.tensor(lens, dtype=torch.int32))

    def runs(self, queries: int, route: AttentionRoute, gen: torch.Generator) -> list[Callable[[], object]]:
        """One call per layer, `queries` new tokens per sequence, the kernel as `route` says."""
        s = self.shape
        q = torch.randn(len(self.lens) * queries, s.heads, s.head_dim, generator=gen).to(s.dtype)
        starts = torch.arange(0, q.shape[0] + 1, queries, dtype=torch.int32)
        return [functools.partial(cpp_attention, q, *self.pools, table, self.lens, starts, s.head_dim ** -0.5,
                                  queries, route) for table in self.tables]


def layer_copies(shape: AttentionShape, contexts: list[list[int]]) -> int:
    """Layer copies of steps with these contexts, run in turn (together), so that between two calls on one copy
    cold_bytes() of keys and values are read: the few-sequence steps each filled it alone first (193 MiB built in 0.11
    s on Zen 3, 64 MiB now)."""
    row = kv_record_len(shape.head_dim) if shape.kv_dtype == torch.uint8 else shape.head_dim
    size = torch.empty(0, dtype=shape.kv_dtype).element_size()
    blocks = sum(math.ceil(n / shape.block_size) for lens in contexts for n in lens)
    return max(MIN_LAYERS, math.ceil(cold_bytes() / (2 * blocks * shape.block_size * shape.kv_heads * row * size)))


def cold_bytes() -> int:
    """Twice the last-level cache (64-256 MiB; 128 MiB where unknown): a call on the next copy of a step's keys and
    values finds none of them in the cache."""
    l3 = machine_cache.l3_bytes()
    return 128 << 20 if l3 is None else min(max(2 * l3, 64 << 20), 256 << 20)


def _cache(shape: AttentionShape, blocks: int, gen: torch.Generator) -> torch.Tensor:
    values = torch.randn(blocks, shape.block_size, shape.kv_heads, shape.head_dim, generator=gen)
    return quantize_kv(values) if shape.kv_dtype == torch.uint8 else values.to(shape.kv_dtype)


def time_kernels(runs: dict[str, list[Callable[[], object]]], what: str, rows: int, timer: Timer) -> dict[str, float]:
    """Each kernel's fastest of SAMPLES calls after a warm-up, interleaved, each call on the next layer."""
    samples: dict[str, list[float]] = {k: [] for k in runs}
    calls = 0
    for _ in range(SAMPLES + 1):
        for kernel, layers in runs.items():
            samples[kernel].append(timer(what, kernel, rows, layers[calls % len(layers)]))
            calls += 1
    return {k: min(s[1:]) for k, s in samples.items()}


def step_contexts(regime: str, gen: torch.Generator) -> list[list[int]]:
    """The contexts of each step a regime's calls run (a call runs one layer of every step)."""
    threads = torch.get_num_threads()
    counts = [BUSY_SEQS_PER_THREAD * threads] if regime == "busy" else sorted({1, 2 * threads, 4 * threads - 1})
    return [torch.randint(BUSY_CONTEXTS[0], BUSY_CONTEXTS[1] + 1, (n,), generator=gen).tolist() for n in counts]


def together(runs: list[list[Callable[[], object]]]) -> list[Callable[[], object]]:
    """Per layer, one call that runs that layer of each step in turn (steps with fewer layer copies wrap around)."""
    return [functools.partial(_run_all, [layers[i % len(layers)] for layers in runs])
            for i in range(max(map(len, runs)))]


def _run_all(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


def measure(shape: AttentionShape, timer: Timer = time_call, budget_s: float = BUDGET_S) -> AttentionTable:
    """The tile forms (AttentionShape.tile_forms), then the row and tiled kernels at
    QUERY_COUNTS in each regime, the two in turn, each coarse to fine (next_count): a spent budget costs both their
    boundaries' resolution, not one regime its measurement."""
    ext = kernels.load()  # built (or loaded) before the clock starts
    start, gen = time.perf_counter(), torch.Generator().manual_seed(0)
    table = AttentionTable(rows={r: [] for r in REGIMES}, times={r: {"rows": [], "tile": []} for r in REGIMES},
                           top_rows=QUERY_COUNTS[-1] * shape.group)
    if (names := shape.tile_forms(ext)) is not None:
        prompt = _Step.build(shape, [PROMPT], gen)
        forms = {name: prompt.runs(PROMPT, AttentionRoute(1, 1, name == "pairs", name == "f16"), gen)
                 for name in names}
        table.tile_forms = time_kernels(forms, "prompt", PROMPT * shape.group, timer)
    taken = table.route()
    if shape.dtype == shape.kv_dtype == torch.bfloat16:
        table.chunks = time_chunks(shape, taken, gen, timer)
    kernel_routes = {"rows": AttentionRoute(1 << 30, 1 << 30, taken.tile_pairs, taken.tile_f16),
                     "tile": AttentionRoute(1, 1, taken.tile_pairs, taken.tile_f16)}
    steps: dict[str, list[_Step]] = {}
    won: dict[str, dict[int, bool]] = {r: {} for r in REGIMES}  # per regime: QUERY_COUNTS index -> tiled won
    def spent() -> bool:
        return time.perf_counter() - start > budget_s

    while not spent() and (todo := [(r, i) for r in ("few", "busy") if (i := next_count(won[r])) is not None]):
        for regime, i in todo:
            if spent():
                break
            if regime not in steps:
                contexts = step_contexts(regime, gen)
                steps[regime] = [_Step.build(shape, lens, gen, layer_copies(shape, contexts)) for lens in contexts]
            queries = QUERY_COUNTS[i]
            best = time_kernels({k: together([s.runs(queries, route, gen) for s in steps[regime]])
                                 for k, route in kernel_routes.items()}, regime, queries * shape.group, timer)
            won[regime][i] = best["tile"] <= best["rows"]
            add_count(table, regime, queries * shape.group, best)
    table.seconds = round(time.perf_counter() - start, 3)
    return table


def time_chunks(shape: AttentionShape, route: AttentionRoute, gen: torch.Generator,
                timer: Timer) -> dict[str, list[float]]:
    """The tiled kernel (in the route's form) against flash attention on steps of CHUNK_STEP prompt tokens in prompts
    of CHUNK_QUERIES tokens each, from the longest (where flash attention gains most), down to the first length where
    it does not win by CHUNK_MARGIN: one step timed where it never pays. Compute bound: two layer copies, not enough
    to leave the cache cold."""
    kernel_routes = {"tile": replace(route, tile_min_rows=1, few_tile_min_rows=1, sdpa_min_queries=0),
                     "sdpa": replace(route, sdpa_min_queries=1)}
    chunks: dict[str, list[float]] = {"tile": [], "sdpa": []}
    for queries in reversed(CHUNK_QUERIES):
        step = _Step.build(shape, [queries] * max(1, CHUNK_STEP // queries), gen, MIN_LAYERS)
        best = time_kernels({k: step.runs(queries, r, gen) for k, r in kernel_routes.items()}, "chunk",
                            queries * shape.group, timer)
        for kernel, seconds in best.items():
            chunks[kernel].insert(0, seconds)
        if not flash_wins(best["tile"], best["sdpa"]):
            break
    return chunks


def flash_wins(tile_s: float, sdpa_s: float) -> bool:
    """Flash attention beat the tiled kernel by more than CHUNK_MARGIN."""
    return sdpa_s * (1 + CHUNK_MARGIN) < tile_s


def next_count(won: dict[int, bool]) -> int | None:
    """The QUERY_COUNTS index a regime times next: the fewest queries, then the most, then midway between the
    last count the row kernel won and the next one timed (the tiled kernel's); None once those two are adjacent or
    one kernel won at the end that decides (the tiled kernel at the fewest, the row kernel at the most)."""
    last = len(QUERY_COUNTS) - 1
    if 0 not in won:
        return 0
    if won[0]:
        return None
    if last not in won:
        return last
    if not won[last]:
        return None
    low = max(i for i, tile in won.items() if not tile)
    high = min(i for i in won if i > low)
    return (low + high) // 2 if high - low > 1 else None


def add_count(table: AttentionTable, regime: str, rows: int, best: dict[str, float]) -> None:
    """One timed count into the regime's rows and times, kept ascending."""
    at = bisect.bisect(table.rows[regime], rows)
    table.rows[regime].insert(at, rows)
    for kernel, seconds in best.items():
        table.times[regime][kernel].insert(at, seconds)


def load(key: dict[str, str]) -> AttentionTable | None:
    data = machine_cache.load_json(machine_cache.cache_file(key, "attention"), key)
    try:
        return None if data is None else AttentionTable(**data)
    except TypeError:
        return None


def measurable(shape: AttentionShape) -> bool:
    """Whether the C++ kernel runs this shape here (else the reference attention does, and nothing is chosen)."""
    row = kv_record_len(shape.head_dim) if shape.kv_dtype == torch.uint8 else shape.head_dim
    cache = torch.empty(1, shape.block_size, shape.kv_heads, row, dtype=shape.kv_dtype)
    return kernels.load() is not None and not unsupported_reason(shape.dtype, shape.head_dim, cache)


def tune(shape: AttentionShape, refresh: bool = False,
         timer: Timer = time_call) -> tuple[AttentionRoute, AttentionTable | None]:
    """The route for this machine and shape: cached, else measured now (and cached where nothing else ran beside
    it); STATIC_ROUTE where PAGEDLLM_ATTENTION=static or the C++ kernel does not run the shape. Logs the choice."""
    forced = os.environ.get(FORCE_ENV, "measured")
    if forced not in ("measured", "static"):
        raise ValueError(f"{FORCE_ENV} must be measured or static, got {forced!r}")
    if forced == "static" or not measurable(shape):
        logger.info("attention: %s, not measured (%s)", STATIC_ROUTE,
                    f"{FORCE_ENV}=static" if forced == "static" else "the C++ kernel does not run this shape")
        return STATIC_ROUTE, None
    key = shape.key()
    file = machine_cache.cache_file(key, "attention")
    table = None if refresh else load(key)
    how = f"read from {file}"
    if table is None and not refresh:
        table = machine_cache.unsaved(key, AttentionTable)
        how = how if table is None else "measured earlier in this process while other processes held the cores"
    if table is None:
        sample = machine_cache.cpu_sample()
        with torch.inference_mode():
            table = measure(shape, timer)
        table.key, table.load = key, machine_cache.machine_load()
        table.others_cpu = round(machine_cache.others_since(sample), 2)
        if machine_cache.quiet(table.load, table.others_cpu):
            machine_cache.save_json(file, asdict(table))
            how = f"measured in {table.seconds:.2f} s, cached at {file}"
        else:
            how = (f"measured in {table.seconds:.2f} s while other processes used {table.others_cpu:.2f} CPUs, "
                   f"not cached: measured again next start")
            machine_cache.keep_unsaved(key, table)
    logger.info("attention (%s): %s", how, table.summary())
    return table.route(), table
