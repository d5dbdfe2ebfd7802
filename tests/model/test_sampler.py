"""Sampler: greedy, truncation support and frequencies, seeded reproducibility, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.model import kernels
from pagedllm.model.sampler import SamplingBatch, _logsumexp, _top_k_top_p, apply_penalties, sample
from pagedllm.sampling_params import SamplingParams

TINY_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]


def build(params, vocab_size, prompt_ids=None, output_ids=None, generators=None, eos_token_ids=()):
    n = len(params)
    return SamplingBatch.build(
        params,
        prompt_ids if prompt_ids is not None else [[] for _ in range(n)],
        output_ids if output_ids is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab_size,
        eos_token_ids=eos_token_ids,
    )


@pytest.fixture
def kernels_ext():
    if kernels.load() is None:
        pytest.skip(f"kernels not built: {kernels.build_error()}")
    return kernels.load()


@pytest.fixture(params=["torch", "kernels"])
def ext(request):
    """The sampler's two forms: plain torch, and with the C++ kernels (selection for top-p, one uniform per row)."""
    return None if request.param == "torch" else request.getfixturevalue("kernels_ext")


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Straightforward per-row reference: temperature, top-k, top-p, min-p, in that order, on plain floats."""
    scaled = [x / p.temperature for x in logits]
    keep = set(range(len(logits)))
    order = sorted(range(len(logits)), key=lambda i: -scaled[i])
    if p.top_k > 0:
        keep &= set(order[: p.top_k])

    def renormalised() -> list[float]:
        z = sum(math.exp(scaled[i]) for i in keep)
        return [math.exp(scaled[i]) / z if i in keep else 0.0 for i in range(len(logits))]

    if p.top_p < 1.0:
        probs, total, kept = renormalised(), 0.0, set()
        for i in order:
            if i in keep and total < p.top_p:
                kept.add(i)
                total += probs[i]
        keep = kept
    if p.min_p > 0.0:
        probs = renormalised()
        keep = {i for i in keep if probs[i] >= p.min_p * max(probs)}
    return renormalised()


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    out = list(logits)
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok in set(output):
        out[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return out


def test_greedy_equals_argmax_any_dtype():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(6, 300).to(dtype)
        out = sample(logits, build([SamplingParams(temperature=0.0)] * 6, 300))
        assert torch.equal(out.token_ids, logits.float().argmax(-1))
        assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
        assert out.top_logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.7),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
        SamplingParams(top_k=3, top_p=0.6),  # top-p cuts inside the top-k survivors
        SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.1),
        SamplingParams(top_k=4, min_p=0.3),
    ],
    ids=lambda p: ",".join(
        f"{k}={v}" for k, v in vars(p).items() if k in ("temperature", "top_k", "top_p", "min_p")
    ),
)
def test_support_and_frequencies_match_renormalised_distribution(params, ext):
    rows = 20_000
    torch.manual_seed(1234)
    logits = torch.tensor([TINY_LOGITS] * rows)
    tokens = sample(logits, build([params] * rows, len(TINY_LOGITS)), ext=ext).token_ids
    expected = torch.tensor(reference_probs(TINY_LOGITS, params))
    freq = torch.bincount(tokens, minlength=len(TINY_LOGITS)).float() / rows
    assert set(tokens.tolist()) <= set(torch.nonzero(expected).flatten().tolist())
    assert torch.allclose(freq, expected.float(), atol=0.015), (freq, expected)


MIXED_GROUPS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=2),
    SamplingParams(top_k=5, temperature=0.5),
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(min_p=0.3, temperature=2.0),
]


@pytest.mark.parametrize(
    "groups",
    [MIXED_GROUPS, [*MIXED_GROUPS, SamplingParams(top_k=3, top_p=0.6)]],
    ids=["top-k-only path", "sort path"],
)
def test_each_row_keeps_its_own_parameters(groups, ext):
    per_group = 5000
    params = groups * per_group  # interleaved rows: group g is rows g, g + len(groups), ...
    torch.manual_seed(7)
    tokens = sample(torch.tensor([TINY_LOGITS] * len(params)), build(params, len(TINY_LOGITS)), ext=ext).token_ids
    for g, p in enumerate(groups):
        freq = torch.bincount(tokens[g :: len(groups)], minlength=len(TINY_LOGITS)).float() / per_group
        expected = (
            torch.tensor([1.0] + [0.0] * 7) if p.greedy else torch.tensor(reference_probs(TINY_LOGITS, p))
        )
        assert torch.allclose(freq, expected.float(), atol=0.025), (p, freq, expected)


def test_seeded_generator_gives_the_same_draws(ext):
    logits = torch.tensor([TINY_LOGITS] * 2000)
    params = [SamplingParams(top_p=0.9)] * 2000
    first = sample(logits, build(params, 8, generators=[torch.Generator().manual_seed(5)] * 2000), ext=ext).token_ids
    torch.manual_seed(99)  # the global RNG must not matter
    again = sample(logits, build(params, 8, generators=[torch.Generator().manual_seed(5)] * 2000), ext=ext).token_ids
    assert torch.equal(first, again)


def test_seeded_row_independent_of_batch_and_position(ext):
    vocab, steps = 50, 12
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=7)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_p=0.5, presence_penalty=1.0),
        SamplingParams(seed=3, min_p=0.1),
    ]

    def run(position: int, companions: list[SamplingParams], noise_seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seeded.seed)
        noise = torch.Generator().manual_seed(noise_seed)
        tokens: list[int] = []
        for step in range(steps):
            params = list(companions)
            params.insert(position, seeded)
            gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
            gens[position] = generator
            logits = torch.randn(len(params), vocab, generator=noise)
            logits[position] = torch.randn(vocab, generator=torch.Generator().manual_seed(step))
            outputs = [[1, 2, 3]] * len(params)
            out = sample(
                logits, build(params, vocab, prompt_ids=outputs, output_ids=outputs, generators=gens), ext=ext
            )
            tokens.append(int(out.token_ids[position]))
        return tokens

    alone = run(0, [], noise_seed=0)
    assert len(set(alone)) > 1  # really sampled
    torch.manual_seed(0)
    assert run(0, others, noise_seed=1) == alone
    torch.manual_seed(1)
    assert run(2, others, noise_seed=2) == alone
    assert run(3, others[::-1], noise_seed=3) == alone


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 4),
)
def test_penalties_match_reference(data, rows):
    vocab = 12
    tokens = st.lists(st.integers(0, vocab - 1), max_size=10)
    params, prompts, outputs = [], [], []
    for _ in range(rows):
        params.append(
            SamplingParams(
                repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
                frequency_penalty=data.draw(st.sampled_from([0.0, -0.7, 0.4, 2.0])),
                presence_penalty=data.draw(st.sampled_from([0.0, 1.1, -2.0])),
            )
        )
        prompts.append(data.draw(tokens))
        outputs.append(data.draw(tokens))
    logits = torch.randn(
        rows, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    )
    batch = build(params, vocab, prompt_ids=prompts, output_ids=outputs)
    got = apply_penalties(logits, batch) if batch.output_counts is not None else logits
    want = torch.tensor(
        [reference_penalties(logits[i].tolist(), prompts[i], outputs[i], params[i]) for i in range(rows)]
    )
    assert torch.allclose(got, want, atol=1e-5)


def test_penalties_steer_greedy_and_leave_input_untouched():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0], [3.0, 2.9, 0.0, -1.0], [3.0, 2.9, 0.0, -1.0]])
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2),  # token 0 seen in the prompt -> 2.5 < 2.9
        SamplingParams(temperature=0.0, frequency_penalty=0.1),  # token 0 twice in the output -> 2.8 < 2.9
        SamplingParams(temperature=0.0, presence_penalty=0.05),  # only in the prompt: presence ignores it
    ]
    out = sample(logits, build(params, 4, prompt_ids=[[0], [], [0]], output_ids=[[], [0, 0], []]))
    assert out.token_ids.tolist() == [1, 1, 0]
    assert torch.equal(logits, before)
    assert torch.allclose(
        out.logprobs, torch.log_softmax(before, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    )


def test_min_tokens_masks_eos_and_stop_ids(ext):
    vocab, eos = 10, 9
    logits = torch.full((4, vocab), -5.0)
    logits[:, eos], logits[:, 7], logits[:, 3] = 10.0, 9.0, 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7, 42]),  # 42 >= vocab: ignored
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),  # min_tokens reached
        SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True),  # masks eos all the same
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, build(params, vocab, output_ids=[[1], [1, 2], [], []], eos_token_ids=[eos]), ext=ext)
    assert out.token_ids.tolist() == [3, eos, 7, eos]
    # Sampled rows never draw a banned token either, and nothing is banned without an eos id or stop ids.
    rows = 3000
    hot = torch.zeros(rows, vocab)
    hot[:, eos] = hot[:, 7] = 3.0
    drawn = sample(
        hot, build([SamplingParams(min_tokens=1, stop_token_ids=[7])] * rows, vocab, eos_token_ids=[eos]), ext=ext
    )
    assert not set(drawn.token_ids.tolist()) & {7, eos}
    assert build([SamplingParams(min_tokens=3)], vocab).banned is None
    # A model with several end-of-generation ids (SmolLM2: <|im_end|> and <|endoftext|>) has all of them banned.
    two = build([SamplingParams(temperature=0.0, min_tokens=1)], vocab, output_ids=[[]], eos_token_ids=[eos, 7])
    assert sample(logits[:1], two, ext=ext).token_ids.tolist() == [3]


def test_logprobs_are_raw_log_softmax_and_top_k_sorted(ext):
    torch.manual_seed(3)
    vocab = 400
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=10, repetition_penalty=1.5, logprobs=2),
        SamplingParams(top_p=0.5, seed=1),
        SamplingParams(temperature=2.0, min_p=0.05, logprobs=0),
    ]
    logits = torch.randn(len(params), vocab, dtype=torch.bfloat16)
    gens = [torch.Generator().manual_seed(1) if p.seed is not None else None for p in params]
    out = sample(logits, build(params, vocab, prompt_ids=[[1, 2]] * 4, output_ids=[[3]] * 4, generators=gens), ext=ext)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1), atol=1e-5)
    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (4, 5) and ids.dtype == torch.int64 and values.dtype == torch.float32
    want_values, want_ids = ref.topk(5, dim=-1)
    assert torch.allclose(values, want_values, atol=1e-5)
    assert torch.equal(ids, want_ids)
    assert torch.all(values[:, :-1] >= values[:, 1:])

    only_chosen = sample(logits, build([SamplingParams(logprobs=0)] * 4, vocab), ext=ext)
    assert only_chosen.top_logprobs[0].shape == (4, 0)


def test_mixed_batch_greedy_sampled_and_seeded(ext):
    torch.manual_seed(11)
    vocab = 64
    logits = torch.randn(5, vocab)
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(top_p=0.3, seed=123),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.9, seed=5),
    ]
    outputs = [[int(logits[0].argmax())] * 3, [], [], [], []]

    def gens():
        return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]

    batch = build(params, vocab, output_ids=outputs, generators=gens())
    out = sample(logits, batch, ext=ext)
    penalised = apply_penalties(logits, batch)
    assert int(out.token_ids[0]) == int(penalised[0].argmax()) != int(logits[0].argmax())
    assert int(out.token_ids[3]) == int(logits[3].argmax())
    assert int(out.token_ids[1]) in logits[1].topk(3).indices.tolist()
    allowed_top_p = (
        torch.nonzero(torch.tensor(reference_probs(logits[2].tolist(), params[2]))).flatten().tolist()
    )
    assert int(out.token_ids[2]) in allowed_top_p
    probs = logits[4].softmax(-1)
    assert float(probs[out.token_ids[4]]) >= 0.9 * float(probs.max())
    again = sample(logits, build(params, vocab, output_ids=outputs, generators=gens()), ext=ext)
    assert out.token_ids[[2, 4]].tolist() == again.token_ids[[2, 4]].tolist()


def test_no_sort_unless_top_p(monkeypatch):
    """The vocab is 49152 wide: only top-p without a top_k may sort it; greedy must not even topk it."""
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)

    def forbidden(*args, **kwargs):
        raise AssertionError("unexpected sort")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch, "sort", forbidden)
    sample(logits, build([SamplingParams(top_k=50), SamplingParams(), SamplingParams(min_p=0.1)], 1000))
    # top-p with a top_k on every row sorts only the widest top-k candidates.
    params = [SamplingParams(top_k=50, top_p=0.9), SamplingParams(top_k=5, top_p=0.5, seed=1)]
    sample(logits[:2], build(params, 1000, generators=[None, torch.Generator().manual_seed(1)]))
    monkeypatch.setattr(torch.Tensor, "topk", forbidden)
    softmaxes = []
    softmax = torch.Tensor.softmax
    monkeypatch.setattr(torch.Tensor, "softmax", lambda self, *a, **k: softmaxes.append(1) or softmax(self, *a, **k))
    assert torch.equal(
        sample(logits, build([SamplingParams(temperature=0)] * 3, 1000)).token_ids, logits.argmax(-1)
    )
    assert len(softmaxes) == 1  # the chosen tokens' logprobs' logsumexp; no distribution to draw from


def test_batch_fields_are_none_when_unused():
    batch = build([SamplingParams(), SamplingParams(temperature=0.0, top_k=5000)], 100)
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    assert batch.output_counts is None and batch.seen_mask is None and batch.banned is None
    assert batch.generators == {} and batch.num_logprobs is None
    assert not batch.all_greedy and not batch.all_random


def test_greedy_from_top_picks_the_lowest_id_among_equal_maxima() -> None:
    from pagedllm.model.sampler import sample_greedy_from_top

    values = torch.tensor([[3.0, 5.0, 5.0, 1.0], [2.0, 1.0, 0.0, -1.0]])
    ids = torch.tensor([[7, 9, 4, 2], [11, 3, 5, 6]])
    out = sample_greedy_from_top(values, ids, torch.tensor([6.0, 2.5]))
    assert out.token_ids.tolist() == [4, 11]
    assert out.logprobs.tolist() == [-1.0, -0.5]
    # banned (row, id) pairs drop out: row 0 loses 4 and 9 (both maxima), row 1 loses 11; ids not among a row's
    # candidates (5 in row 0) change nothing
    banned = (torch.tensor([0, 0, 1, 0]), torch.tensor([4, 9, 11, 5]))
    out = sample_greedy_from_top(values, ids, torch.tensor([6.0, 2.5]), banned)
    assert out.token_ids.tolist() == [7, 3]
    assert out.logprobs.tolist() == [-3.0, -1.5]


def test_plain_greedy_needs_nothing_else() -> None:
    plain = build([SamplingParams(temperature=0)] * 2, 10)
    assert plain.is_plain_greedy
    # min_tokens bans a few ids: the fast path skips them among its 16 candidates; more than 8 need the full row
    assert build([SamplingParams(temperature=0, min_tokens=3)], 10, eos_token_ids=(2,)).is_plain_greedy
    many_stops = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=list(range(3, 12)))
    for params in (SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0, repetition_penalty=1.2),
                   many_stops, SamplingParams(temperature=1)):
        assert not build([params], 20, eos_token_ids=(2,)).is_plain_greedy, params


def test_logsumexp_matches_torch_on_plain_masked_and_empty_rows():
    """The logprobs' logsumexp (from the softmax's largest probability) equals torch's, and a row the grammar masks
    entirely gives -inf, not NaN."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5000) * 4
    logits[1, 10:] = float("-inf")  # a grammar-masked row
    logits[2] = float("-inf")  # nothing allowed
    logits[3, 0] = 80.0  # one token far ahead of the rest
    got = _logsumexp(logits)
    torch.testing.assert_close(got, logits.logsumexp(-1))
    assert got[2] == float("-inf")


def test_truncation_by_selection_keeps_what_the_sort_keeps(kernels_ext):
    """The kernels' top-p threshold (selection among the tokens above (1 - p) / n) keeps exactly the tokens the
    full sort keeps, after a top_k or without, on flat and peaked rows, with a grammar's -inf among them."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 49_152, 48
    x = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.3, 6.0, rows)[:, None]
    x[5, 100:] = float("-inf")  # a grammar-masked row
    x[6, 3] = 40.0  # one token takes all the mass
    top_p = torch.tensor([0.05, 0.5, 0.9, 0.95, 0.999, 1.0] * (rows // 6))
    top_k = torch.full((rows,), vocab)
    top_k[::4] = torch.tensor([1, 7, 50, 2000] * (rows // 16))[: rows // 4]
    cut = x.clone()
    threshold = kernels_ext.truncate_(cut, top_k, top_p)
    want = _top_k_top_p(x.clone(), top_k, int(top_k[top_k < vocab].max()), top_p)
    assert torch.equal(torch.isfinite(cut), torch.isfinite(want))
    assert torch.equal(cut[torch.isfinite(cut)], x[torch.isfinite(cut)])  # the kept logits untouched
    assert torch.equal(torch.isfinite(cut), (x >= threshold[:, None]) & torch.isfinite(x))
    assert threshold[top_p == 1.0][top_k[top_p == 1.0] == vocab].eq(float("-inf")).all()  # nothing to cut
    assert int(torch.isfinite(cut[6]).sum()) == 1
    # top-p alone (no top_k tensor) is the same cut as with every top_k off
    alone = kernels_ext.truncate_(x.clone(), None, top_p)
    assert torch.equal(alone, kernels_ext.truncate_(x.clone(), torch.full((rows,), vocab), top_p))
    # a top_p that rounds to 0 in float32 on a flat row: the top (every tied token) stays, never an empty row
    flat = torch.zeros(1, 64)
    assert kernels_ext.truncate_(flat, None, torch.tensor([1e-50], dtype=torch.float32)).tolist() == [0.0]
    assert torch.isfinite(flat).all()


def test_the_draw_follows_the_inverse_cdf(kernels_ext):
    """draw_rows picks the first token whose cumulative probability passes the row's uniform; -inf and NaN logits
    are never drawn, not even at u = 0 or u close to 1."""
    gen = torch.Generator().manual_seed(1)
    rows, vocab = 300, 1000
    x = torch.randn(rows, vocab, generator=gen) * 2
    x[:, ::7] = float("-inf")
    u = torch.rand(rows, generator=gen)
    probs = x.double().softmax(-1)
    want = (probs.cumsum(-1) <= u.double()[:, None]).sum(-1)
    assert torch.equal(kernels_ext.draw_rows(x, u), want)
    edge = torch.full((3, 5), float("-inf"))
    edge[0, 2], edge[0, 3] = 1.0, 2.0  # u = 0: the first token that can be drawn
    edge[1, 1], edge[1, 0] = 1.0, float("nan")  # u just below 1: the last, never the NaN
    edge[1, 4] = float("nan")
    drawn = kernels_ext.draw_rows(edge, torch.tensor([0.0, 1.0 - 2**-24, 0.5]))
    assert drawn.tolist() == [2, 1, 0]  # a row with nothing to draw gives 0


def test_top_p_without_a_top_k_sorts_nothing_with_the_kernels(kernels_ext, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("unexpected sort")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch, "sort", forbidden)
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=5, top_p=0.5), SamplingParams(temperature=0)]
    out = sample(logits, build(params, 1000), ext=kernels_ext)
    assert int(out.token_ids[1]) in logits[1].topk(5).indices.tolist()
    assert int(out.token_ids[2]) == int(logits[2].argmax())
