"""Prompt chunks on torch's flash attention for CPU, where it beats the tiled kernel (issue 27). On an Intel Xeon with
AMX its bf16 products run on oneDNN's brgemm (AMX tiles): a 1,024-token prompt 2.6 ms a layer against the tiled
kernel's 4.3 ms (model/attention_dispatch.py times the two where the engine runs and sets the route's
`sdpa_min_queries`). A sequence with that many queries in the step has its keys and values gathered from its blocks
(views of one copy, ~1.5 MB for 1,900 tokens of the default model; its query heads share them, enable_gqa: 2.2 ms
against 2.4 with a copy per query head) and attends in one call, causal, or with a mask where keys
were cached before this chunk. The other sequences go to the C++ kernel together."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def applies(dtype: torch.dtype, k_cache: torch.Tensor, max_query_len: int, min_queries: int) -> bool:
    """Whether a step's call takes this path: bf16 queries over a bf16 cache, a chunk of at least `min_queries`."""
    return (0 < min_queries <= max_query_len and dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, min_queries: int,
           others: Kernel) -> torch.Tensor:
    """The step's attention with each chunk of `min_queries` or more on flash attention; `others(q, tables, lens,
    starts)` runs the rest (the C++ kernel on their queries, gathered: a few tensor ops, not one per sequence)."""
    starts = query_start_loc.long()
    counts = starts[1:] - starts[:-1]
    big = counts >= min_queries
    first, last = int(starts[0]), int(starts[-1])
    out = torch.empty_like(q)
    out[:first].zero_()
    out[last:].zero_()
    bounds, lens = starts.tolist(), context_lens.tolist()
    for s in big.nonzero().flatten().tolist():
        out[bounds[s]:bounds[s + 1]] = _sequence(q[bounds[s]:bounds[s + 1]], k_cache, v_cache, block_tables[s],
                                                 lens[s], scale)
    rest = ~big & (counts > 0)
    if bool(rest.any()):
        picked = rest.nonzero().flatten()
        rows = rest.repeat_interleave(counts).nonzero().flatten() + first
        sub_starts = torch.cat([counts.new_zeros(1), counts[picked].cumsum(0)])
        out[rows] = others(q[rows], block_tables[picked], context_lens[picked], sub_starts)
    return out


def _sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, context: int,
              scale: float) -> torch.Tensor:
    """One sequence's `n` queries ``[n, H, D]`` (the last `n` of its `context` tokens) over its cached keys."""
    n = q.shape[0]
    blocks = table[: math.ceil(context / k_cache.shape[1])].long()
    k, v = (cache[blocks].flatten(0, 1)[:context].transpose(0, 1).unsqueeze(0) for cache in (k_cache, v_cache))
    mask = None if context == n else _mask(n, context)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@functools.lru_cache(maxsize=4)
def _mask(n: int, context: int) -> torch.Tensor:
    """Which keys each of a chunk's queries sees (is_causal aligns a non-square mask top-left, the chunk's queries
    are the last); kept for the step's other layers."""
    return torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
