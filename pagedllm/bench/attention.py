"""`pagedllm bench attention`: the paged C++ kernel against the same kernel over consecutive blocks (the cost of the
paging indirection itself), the plain-PyTorch reference and PyTorch SDPA over a dense, non-paged cache, on the same
keys and values (the vLLM paper's "paging makes the kernel 20-26% slower" question)."""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.bench.latency import finish

COLD_BYTES = 128 << 20  # 4x this machine's L3: K/V spread over this many bytes of layers come from memory
HEAD_DIM, BLOCK_SIZE = 64, 16


@dataclass
class AttentionCase:
    kind: str  # "decode" (one query per sequence) or "prefill" (one sequence, causal over its whole prompt)
    lens: list[int]  # context length of each sequence
    heads: int
    kv_heads: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        ctx = f"ctx {min(self.lens)}-{max(self.lens)}" if len(set(self.lens)) > 1 else f"ctx {self.lens[0]}"
        return f"{self.kind} {len(self.lens)} seqs, {ctx}, {self.heads}/{self.kv_heads}x{HEAD_DIM}"


def attention_cases(quick: bool, gen: torch.Generator) -> list[AttentionCase]:
    """Decode: 32 sequences of ~U(100, 1000) tokens; prefill: one 512- or 2048-token prompt. The default model's
    head shape (9 query / 3 KV heads) and a plain multi-head one, fp32 and bf16. --quick: tiny sizes."""
    heads = [(4, 2)] if quick else [(9, 3), (12, 12)]
    decode_lens = torch.randint(20, 61, (4,), generator=gen) if quick else torch.randint(100, 1001, (32,),
                                                                                           generator=gen)
    prefill_lens = (32,) if quick else (512, 2048)
    cases = []
    for h, kvh in heads:
        for dtype in (torch.float32, torch.bfloat16):
            cases.append(AttentionCase("decode", decode_lens.tolist(), h, kvh, dtype))
            cases += [AttentionCase("prefill", [n], h, kvh, dtype) for n in prefill_lens]
    return cases


@dataclass
class AttentionInputs:
    """One case's queries and the same keys/values three ways, for each of `layers` layers used in turn: blocks
    scattered in random order (paging), the same blocks consecutive per sequence, and a dense padded tensor."""

    q: torch.Tensor  # [T, H, D]
    scattered: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [blocks, block, Hkv, D]
    scattered_tables: torch.Tensor  # int32 [S, max_blocks]
    consecutive: list[tuple[torch.Tensor, torch.Tensor]]
    consecutive_tables: torch.Tensor  # sequence s's blocks are offsets[s] .. offsets[s] + n_s - 1
    dense: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [S, Hkv, max_len, D]
    context_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    max_query_len: int


def attention_inputs(case: AttentionCase, gen: torch.Generator) -> AttentionInputs:
    lens = case.lens
    nblocks = [math.ceil(n / BLOCK_SIZE) for n in lens]
    total = sum(nblocks)
    elem = torch.empty((), dtype=case.dtype).element_size()
    layers = min(4, math.ceil(COLD_BYTES / (2 * total * BLOCK_SIZE * case.kv_heads * HEAD_DIM * elem)))
    offsets = [0, *torch.tensor(nblocks).cumsum(0).tolist()]
    consecutive_tables = torch.zeros(len(lens), max(nblocks), dtype=torch.int32)
    for s, n in enumerate(nblocks):
        consecutive_tables[s, :n] = torch.arange(offsets[s], offsets[s] + n)
    where = torch.randperm(total, generator=gen)  # consecutive block i lives at scattered block where[i]
    scattered_tables = where[consecutive_tables.long()].to(torch.int32)  # padding entries: any valid block
    consecutive, scattered, dense = [], [], []
    for _ in range(layers):
        kv = [torch.randn(total, BLOCK_SIZE, case.kv_heads, HEAD_DIM, generator=gen).to(case.dtype) for _ in "kv"]
        consecutive.append(tuple(kv))
        scattered.append(tuple(torch.empty_like(t).index_copy_(0, where, t) for t in kv))
        dense.append(tuple(dense_cache(t, lens, offsets) for t in kv))
    decode = case.kind == "decode"
    num_q = len(lens) if decode else lens[0]
    return AttentionInputs(
        q=torch.randn(num_q, case.heads, HEAD_DIM, generator=gen).to(case.dtype),
        scattered=scattered, scattered_tables=scattered_tables, consecutive=consecutive,
        consecutive_tables=consecutive_tables, dense=dense, context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32) if decode else
        torch.tensor([0, lens[0]], dtype=torch.int32), max_query_len=1 if decode else lens[0])


def dense_cache(blocks: torch.Tensor, lens: list[int], offsets: list[int]) -> torch.Tensor:
    """[S, Hkv, max_len, D], zero-padded: each sequence's consecutive blocks, as SDPA wants them."""
    out = torch.zeros(len(lens), blocks.shape[2], max(lens), blocks.shape[3], dtype=blocks.dtype)
    for s, n in enumerate(lens):
        out[s, :, :n] = blocks[offsets[s]:offsets[s + 1]].flatten(0, 1)[:n].transpose(0, 1)
    return out


def attention_variants(case: AttentionCase, x: AttentionInputs) -> dict[str, Callable[[int], torch.Tensor]]:
    """Call i of each variant runs layer i mod layers; each returns [T, H, D]."""
    from pagedllm.model.attention import paged_attention

    scale = HEAD_DIM ** -0.5

    def paged(caches: list, tables: torch.Tensor, backend: str) -> Callable[[int], torch.Tensor]:
        return lambda i: paged_attention(x.q, *caches[i % len(caches)], tables, x.context_lens, x.query_start_loc,
                                         scale, x.max_query_len, backend)

    if case.kind == "decode":  # one query per sequence, padding keys masked off
        q4 = x.q.unsqueeze(2)  # [S, H, 1, D]
        mask = (torch.arange(max(case.lens))[None, :] < x.context_lens[:, None]).view(len(case.lens), 1, 1, -1)
        unpack = lambda o: o.squeeze(2)  # noqa: E731
    else:  # one causal sequence
        q4, mask = x.q.transpose(0, 1).unsqueeze(0), None  # [1, H, T, D]
        unpack = lambda o: o[0].transpose(0, 1)  # noqa: E731

    def sdpa(i: int) -> torch.Tensor:
        k, v = x.dense[i % len(x.dense)]
        return unpack(F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                     enable_gqa=True))

    return {"cpp": paged(x.scattered, x.scattered_tables, "cpp"),
            "cpp_consecutive": paged(x.consecutive, x.consecutive_tables, "cpp"),
            "reference": paged(x.scattered, x.scattered_tables, "reference"), "sdpa": sdpa}


def median_ms(variants: dict[str, Callable[[int], object]], repeats: int) -> dict[str, float]:
    """Round-robin over the variants, so background load hits them alike; round 0 warms up. The slow reference
    runs only in the first few rounds."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeats + 1):
        for name, fn in variants.items():
            if name == "reference" and i > max(2, repeats // 5):
                continue
            start = time.perf_counter()
            fn(i)
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def bench_attention(threads: int | None = None, repeats: int = 15, quick: bool = False,
                    seed: int = 0) -> list[dict[str, Any]]:
    """One row per case: median ms per layer call of each variant, the cost of paging (the kernel over scattered
    blocks / over consecutive ones) and the kernel against SDPA; the variants' outputs are checked to agree."""
    from pagedllm.model import kernels

    if kernels.load() is None:
        raise ValueError(f"the C++ attention kernel did not build: {kernels.build_error()}")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for case in attention_cases(quick, gen):
        x = attention_inputs(case, gen)
        variants = attention_variants(case, x)
        with torch.inference_mode():
            out = {name: fn(0).float() for name, fn in variants.items()}
            ms = median_ms(variants, max(3, repeats * 256 // case.lens[0]) if case.kind == "prefill" else repeats)
        rows.append({
            "case": case.name, "kind": case.kind, "seqs": len(case.lens), "tokens": sum(case.lens),
            "heads": case.heads, "kv_heads": case.kv_heads, "head_dim": HEAD_DIM, "dtype": str(case.dtype)[6:],
            "layers": len(x.scattered), **{f"{name}_ms": round(v, 4) for name, v in ms.items()},
            "paging_cost": round(ms["cpp"] / ms["cpp_consecutive"], 3),
            "cpp_over_sdpa": round(ms["cpp"] / ms["sdpa"], 3),
            "same_output_consecutive": bool(torch.equal(out["cpp"], out["cpp_consecutive"])),
            "max_abs_diff": {name: float((o - out["reference"]).abs().max()) for name, o in out.items()
                             if name != "reference"}})
    return rows


def print_attention_table(rows: list[dict[str, Any]], threads: int) -> None:
    print(f"torch threads={threads}; median ms per layer call. cpp: the paged kernel, blocks in random order; "
          "consecutive: the same kernel, each sequence's blocks consecutive; SDPA: a dense, non-paged cache")
    print("| case | dtype | cpp | cpp consecutive | paging cost | reference | contiguous SDPA | cpp / SDPA |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['dtype']} | {r['cpp_ms']:.3f} | {r['cpp_consecutive_ms']:.3f} | "
              f"{r['paging_cost']:.2f}x | {r['reference_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['cpp_over_sdpa']:.2f} |")


def plot_attention(result: dict[str, Any], path: str) -> None:
    """Grouped bars (log scale): each variant's ms per call, per case."""
    from pagedllm.bench.plots import pyplot

    plt = pyplot()
    rows = result["rows"]
    variants = {"cpp": "cpp (paged)", "cpp_consecutive": "cpp (consecutive)", "sdpa": "SDPA (dense)",
                "reference": "reference"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5))
    width = 0.8 / len(variants)
    for k, (name, label) in enumerate(variants.items()):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], [r[f"{name}_ms"] for r in rows], width,
               label=label)
    ax.set_xticks(range(len(rows)), [f"{r['case'].replace(', ', chr(10))}\n{r['dtype']}" for r in rows],
                  fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer call (median)")
    ax.set_title(f"attention kernels, {result['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_attention(args: argparse.Namespace) -> int:
    threads = args.threads or os.cpu_count() or 1
    if args.repeats < 1:
        raise ValueError(f"--repeats must be positive, got {args.repeats}")
    load_before = os.getloadavg()
    rows = bench_attention(threads, args.repeats, args.quick, args.seed)
    print_attention_table(rows, threads)
    result = {"threads": threads, "repeats": args.repeats, "quick": args.quick, "block_size": BLOCK_SIZE,
              "machine": f"{platform.machine()} {os.cpu_count()} cpus",
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    return finish(args, result, plot_attention)


def add_command(sub: argparse._SubParsersAction) -> None:
    at = sub.add_parser("attention", help="the paged attention kernel against the same kernel over consecutive "
                                          "blocks, the reference and SDPA over a dense cache")
    at.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    at.add_argument("--repeats", type=int, default=15, help="timed calls per variant (prefill: scaled down)")
    at.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    at.add_argument("--seed", type=int, default=0)
    at.add_argument("--output-json", default=None)
    at.add_argument("--plot", default=None, help="PNG bar chart of the variants' times")
    at.set_defaults(func=cmd_attention)
