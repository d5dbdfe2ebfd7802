"""Turn one step's logits into next tokens (penalties, min_tokens, greedy, temperature, top-k/p, min-p).

Follows vLLM's sampler. All work is batched over the S sampling rows of the step; the only Python loop over
rows is the draw of per-request seeded generators, so a seeded request's tokens do not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import chain
from types import ModuleType

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# The greedy fast path keeps each row's top 16 candidates (llama.RESCORE_TOP_K); with at most this many tokens banned
# by min_tokens (the EOS ids and stop_token_ids), half of them are always left to pick from.
FAST_GREEDY_MAX_BANNED = 8


class GrammarMask:
    """The tokens a grammar allows next, for the constrained sampling rows of a step (the engine's matchers fill it;
    unconstrained rows are not in it). The bitmask may still be filling on another thread while the model runs (it
    depends only on tokens already accepted): reading `bitmask` waits for it, so the forward does not."""

    def __init__(self, rows: torch.Tensor, bitmask: torch.Tensor | Future[torch.Tensor]) -> None:
        self.rows = rows  # int64 [R]: the sampling rows the grammar constrains
        self._bitmask = bitmask

    @property
    def bitmask(self) -> torch.Tensor:
        """int32 [R, ceil(V / 32)]: bit t % 32 of word t // 32 set = token t allowed (llguidance's layout)."""
        if isinstance(self._bitmask, Future):
            self._bitmask = self._bitmask.result()
        return self._bitmask


@dataclass
class SamplingBatch:
    """Per-step tensors for the S sequences that sample this step (built once per step, vectorised).

    Optional fields are None when no row uses the feature, so a step pays only for what its requests ask for.
    """

    temperature: torch.Tensor  # float32 [S]; 1.0 on greedy rows so dividing by it is harmless
    greedy: torch.Tensor  # bool [S]
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # int64 [S], vocab_size where disabled
    max_top_k: int  # largest enabled top_k (0 if none): the width of the top-k-only path's topk
    top_p: torch.Tensor | None  # float32 [S], 1.0 where disabled
    min_p: torch.Tensor | None  # float32 [S], 0.0 where disabled
    repetition_penalty: torch.Tensor | None  # float32 [S], 1.0 where disabled
    frequency_penalty: torch.Tensor | None  # float32 [S]
    presence_penalty: torch.Tensor | None  # float32 [S]
    seen_mask: torch.Tensor | None  # bool [S, V]: token occurs in prompt or output (repetition penalty)
    output_counts: torch.Tensor | None  # float32 [S, V]: occurrences in the output (all three penalties)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked to -inf by min_tokens
    max_banned_per_row: int
    generators: dict[int, torch.Generator]  # row -> its generator (a seeded request's, at the row's position)
    num_logprobs: int | None  # K = most top logprobs any row asked for; None if nobody asked
    grammar: GrammarMask | None = None  # structured outputs: -inf on the tokens their grammar forbids

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        *,
        eos_token_ids: Collection[int] = (),
        grammar: GrammarMask | None = None,
    ) -> SamplingBatch:
        """Gather the rows' parameters into [S] tensors and their token histories into [S, V] counts.

        Repetition penalty counts prompt + output tokens (as vLLM/HF); presence and frequency count output
        only (as OpenAI/vLLM). While a row has fewer than min_tokens outputs, every EOS id and its stop_token_ids
        are banned, whether or not it ignores EOS.
        """
        vocab = vocab_size
        greedy_rows = [p.greedy for p in params]
        greedy = torch.tensor(greedy_rows, dtype=torch.bool)
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        # each knob's [S] tensor only where a row sets it: deciding from the params costs no tensor (a greedy batch
        # made six [S] tensors it never read, and 15 small ops to find that out: ~0.1 ms a step, AMD EPYC Zen 4)
        top_ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        top_k_on = [k < vocab for k in top_ks]
        top_p = _floats([p.top_p for p in params], lambda x: x < 1.0)
        min_p = _floats([p.min_p for p in params], lambda x: x > 0.0)
        rep = _floats([p.repetition_penalty for p in params], lambda x: x != 1.0)
        freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32) if freq_pres else None
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32) if freq_pres else None

        seen_mask = output_counts = None
        if rep is not None or freq_pres:
            penalised = [p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                         for p in params]
            output_counts = _token_counts(output_ids, penalised, vocab)
            if rep is not None:
                seen_mask = (_token_counts(prompt_ids, penalised, vocab) > 0) | (output_counts > 0)

        banned_pairs = [
            (row, tok)
            for row, p in enumerate(params)
            if len(output_ids[row]) < p.min_tokens
            for tok in {*p.stop_token_ids, *eos_token_ids}
            if tok < vocab
        ]
        banned = None
        if banned_pairs:
            banned = tuple(torch.tensor(banned_pairs, dtype=torch.int64).T)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            greedy=greedy,
            all_greedy=all(greedy_rows),
            all_random=not any(greedy_rows),
            top_k=torch.tensor(top_ks) if any(top_k_on) else None,
            max_top_k=max((k for k, on in zip(top_ks, top_k_on) if on), default=0),
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            seen_mask=seen_mask,
            output_counts=output_counts,
            banned=banned,
            max_banned_per_row=int(banned[0].bincount().max()) if banned is not None else 0,
            generators={
                row: gen
                for row, (gen, p) in enumerate(zip(generators, params, strict=True))
                if gen is not None and not p.greedy
            },
            num_logprobs=min(max(requested), vocab) if requested else None,
            grammar=grammar,
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that needs the whole distribution: the top candidates and logsumexp suffice (a few
        min_tokens bans included: a banned candidate just drops out of them)."""
        return (self.all_greedy and self.output_counts is None and self.num_logprobs is None
                and self.max_banned_per_row <= FAST_GREEDY_MAX_BANNED)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor  # float32 [S], logprob of the chosen token under the raw model distribution
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # (ids int64 [S, K], values float32 [S, K])
    ranks: torch.Tensor | None = None  # int64 [S], 1-based rank of the chosen token (only when logprobs are asked)


def sample(logits: torch.Tensor, batch: SamplingBatch, rng: torch.Generator | None = None,
           ext: ModuleType | None = None) -> SamplerOutput:
    """Pick one token per row of logits [S, V] (any float dtype; computed in float32); unseeded rows draw from `rng`.
    With the C++ kernels (`ext`), top-p is found by selection and the draw takes one uniform per row
    (csrc/sampling.cpp).

    Logprobs (chosen and top-K) are those of the model output after the grammar mask, log_softmax(logits) before
    penalties, temperature and truncation, as vLLM V1 returns by default ("raw_logprobs").
    Order: grammar mask -> penalties -> min_tokens ban -> greedy argmax | temperature -> top-k -> top-p -> min-p
    -> draw.
    """
    raw = logits.float()
    if batch.grammar is not None:
        apply_grammar_mask_(raw, batch.grammar)
    x = raw
    if batch.output_counts is not None:
        x = apply_penalties(x, batch)
    if batch.banned is not None:
        x = x.index_put(batch.banned, torch.tensor(_NEG_INF))
    if batch.all_greedy:
        token_ids = x.argmax(dim=-1)
    elif batch.all_random:
        token_ids = _sample_random(x, batch, rng, ext)
    else:
        token_ids = torch.where(batch.greedy, x.argmax(dim=-1), _sample_random(x, batch, rng, ext))
    return _logprobs(raw, token_ids, batch.num_logprobs, ext)


def sample_greedy_from_top(values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor,
                           banned: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplerOutput:
    """Greedy from each row's top candidates (values/ids [S, k]) and logsumexp [S]: the largest value, the lowest
    id among equal ones (as argmax over the whole row picks); candidates `banned` (rows, ids) by min_tokens are
    skipped, and the logprob stays the raw distribution's, as `sample` reports it."""
    if banned is not None:
        rows, toks = banned
        hits = torch.zeros(ids.shape, dtype=torch.int32).index_put_((rows,), (ids[rows] == toks[:, None]).int(),
                                                                     accumulate=True)
        values = values.masked_fill(hits.bool(), _NEG_INF)
    best = values.max(dim=-1, keepdim=True).values
    token_ids = torch.where(values == best, ids, torch.iinfo(torch.int64).max).min(dim=-1).values
    return SamplerOutput(token_ids=token_ids, logprobs=best.squeeze(1) - lse, top_logprobs=None)


def apply_grammar_mask_(logits: torch.Tensor, mask: GrammarMask) -> None:
    """-inf on every token the grammar forbids, in place, on the mask's rows only. Plain torch and numpy (llguidance's
    own torch helper is torch.compile'd: seconds and a C++ compiler on first use)."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(mask.bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    forbidden = torch.from_numpy(bits).view(torch.bool).logical_not_()
    if mask.rows.shape[0] == logits.shape[0]:  # every row constrained: the rows are 0..S-1 in order
        logits.masked_fill_(forbidden, _NEG_INF)
    else:
        logits[mask.rows] = logits[mask.rows].masked_fill_(forbidden, _NEG_INF)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency and presence penalties as vLLM applies them; returns a new tensor."""
    if batch.repetition_penalty is not None:
        assert batch.seen_mask is not None
        penalty = torch.where(batch.seen_mask, batch.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if batch.frequency_penalty is not None and batch.presence_penalty is not None:
        assert batch.output_counts is not None
        logits = logits - batch.frequency_penalty[:, None] * batch.output_counts
        logits = logits - batch.presence_penalty[:, None] * (batch.output_counts > 0)
    return logits


def _sample_random(logits: torch.Tensor, batch: SamplingBatch, rng: torch.Generator | None,
                   ext: ModuleType | None) -> torch.Tensor:
    """Temperature, truncation, then the draw. With the kernels: one uniform per row, by inverse CDF. Without:
    vLLM's exponential race (argmax p/q, q ~ Exp(1), made as -log(U): the same noise, about 4x cheaper on CPU than
    Tensor.exponential_). Each seeded row takes its uniforms from its own generator, so its draw does not depend on
    the other rows."""
    x = (logits / batch.temperature[:, None]).contiguous()  # a fresh tensor: in-place from here on is safe
    if batch.top_p is not None and ext is not None and not _every_row_has_top_k(batch.top_k, x.shape[-1]):
        ext.truncate_(x, batch.top_k, batch.top_p)
    elif batch.top_p is not None:  # with a top_k on every row, torch's topk of the widest k is the cheaper cut
        x = _top_k_top_p(x, batch.top_k, batch.max_top_k, batch.top_p)
    elif batch.top_k is not None:
        x = _top_k(x, batch.top_k, batch.max_top_k)
    if batch.min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); min_p == 0 gives -inf, keeping all.
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + batch.min_p.log()[:, None], _NEG_INF)
    if ext is not None:
        return ext.draw_rows(x, _uniforms(batch, rng, (batch.num_rows,)))
    probs = x.softmax(dim=-1)
    u = _uniforms(batch, rng, probs.shape)
    # U = 0 gives q = inf (the token loses); the clamp keeps q > 0, so a masked token never makes 0/0 = NaN.
    q = u.log_().neg_().clamp_min_(torch.finfo(u.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def seed_at(seed: int, position: int) -> int:
    """The seed of a seeded request's draw at an output position: splitmix64 of (seed, position), so that every
    (seed, position) pair gets its own well-mixed stream (torch's CPU generator keeps only the low 32 bits)."""
    z = ((seed % 2**64) * 0x9E3779B97F4A7C15 + position + 1) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) >> 1


def _uniforms(batch: SamplingBatch, rng: torch.Generator | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniforms in [0, 1) with one row per sampling row: seeded rows from their own generators, the rest from rng."""
    u = torch.empty(shape, dtype=torch.float32)
    if len(batch.generators) < batch.num_rows:
        u.uniform_(generator=rng)
    for row, generator in batch.generators.items():
        u[row].uniform_(generator=generator)
    return u


def _every_row_has_top_k(top_k: torch.Tensor | None, vocab: int) -> bool:
    return top_k is not None and bool((top_k < vocab).all())


def _top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k logits (ties with the k-th kept) with one topk of the widest k, not a sort."""
    vocab = x.shape[-1]
    off = top_k >= vocab
    kth = x.topk(max_top_k, dim=-1).values.gather(1, (top_k.masked_fill(off, 1) - 1)[:, None])
    kth.masked_fill_(off[:, None], _NEG_INF)
    return x.masked_fill_(x < kth, _NEG_INF)


def _top_k_top_p(
    x: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor
) -> torch.Tensor:
    """One ascending sort for the batch: top-k, then top-p over the renormalised survivors (vLLM's rule:
    drop the low tail whose cumulative probability is <= 1 - p, always keeping the top token).

    When every row has a top_k, every survivor is among the widest top-k, so only those are sorted (a topk);
    otherwise the whole vocab is.
    """
    if _every_row_has_top_k(top_k, x.shape[-1]):
        x_sorted, order = (t.flip(-1) for t in x.topk(max_top_k, dim=-1))
        out = torch.full_like(x, _NEG_INF)
    else:
        x_sorted, order = x.sort(dim=-1)
        out = x
    if top_k is not None:
        # Index width - k; a disabled row (k == vocab, full sort) gets index 0, the minimum: nothing dropped.
        kth = x_sorted.gather(1, (x_sorted.shape[-1] - top_k)[:, None])
        x_sorted.masked_fill_(x_sorted < kth, _NEG_INF)
    cumulative = x_sorted.softmax(dim=-1).cumsum_(dim=-1)
    drop = (cumulative <= (1.0 - top_p)[:, None]) & (top_p < 1.0)[:, None]
    drop[:, -1] = False
    x_sorted.masked_fill_(drop, _NEG_INF)
    return out.scatter_(-1, order, x_sorted)


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int | None, ext: ModuleType | None) -> SamplerOutput:
    """Logprobs of the raw distribution without materialising log_softmax: logit - logsumexp (the kernels' one pass
    over each row where they are built)."""
    lse = _logsumexp(raw) if ext is None else ext.top_k_logsumexp(raw.contiguous(), 1)[2]
    chosen_logit = raw.gather(1, token_ids[:, None])
    chosen = chosen_logit.squeeze(1) - lse
    top = ranks = None
    if k is not None:
        values, ids = raw.topk(k, dim=-1)
        top = (ids, values - lse[:, None])
        ranks = (raw > chosen_logit).sum(dim=-1) + 1
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=top, ranks=ranks)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp as max - log(largest softmax probability): torch's logsumexp is 1.5-2x slower on a plain
    row and 4-6x on a grammar-masked one (its exp of -inf is slow; the softmax kernel's is not;
    docs/scripts/mask_costs.py). A row of -inf gives -inf."""
    top = x.amax(dim=-1)
    return torch.where(top == _NEG_INF, top, top - x.softmax(dim=-1).amax(dim=-1).log())


def _floats(values: list[float], on: Callable[[float], bool]) -> torch.Tensor | None:
    """The rows' values as a float32 [S] tensor if any row's value is `on`, else None (the knob is off)."""
    return torch.tensor(values, dtype=torch.float32) if any(map(on, values)) else None


def _token_counts(token_lists: list[list[int]], rows_on: list[bool], vocab_size: int) -> torch.Tensor:
    """Count the tokens of the rows that are on into a float32 [S, V] tensor: one scatter_add over the lists
    flattened (rather than padded) into one tensor."""
    token_lists = [ids if on else [] for ids, on in zip(token_lists, rows_on, strict=True)]
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32)
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    counts.view(-1).scatter_add_(0, rows * vocab_size + flat, torch.ones(flat.shape[0]))
    return counts
