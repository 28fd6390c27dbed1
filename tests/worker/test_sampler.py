"""gpu_worker.sampler: greedy, temperature, top-k, top-p, masking, seeds, logprobs."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from gpu_worker.logits_shaping import History
from gpu_worker.sampler import (
    SampleOutput,
    Sampler,
    argmax,
    keyed_exponentials,
    open_unit,
    sample_key,
)
from ipc.schema import NO_TOKEN
from shared.sampling import SamplingParams

CPU = torch.device("cpu")
SAMPLER = Sampler()


@pytest.fixture(autouse=True)
def _fixed_default_rng() -> None:
    """Unseeded rows use torch's default RNG: fix it so every test is deterministic."""
    torch.manual_seed(1234)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int | None] | None = None,
    masked: Sequence[Sequence[int]] | None = None,
) -> SampleOutput:
    rows = logits.shape[0]
    return SAMPLER.sample(
        logits,
        params,
        keys if keys is not None else [None] * rows,
        masked if masked is not None else [()] * rows,
    )


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def repeat(logits_row: torch.Tensor, times: int) -> torch.Tensor:
    return logits_row[None, :].expand(times, -1).contiguous()


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(16, 100, seed=1).to(dtype)
    out = sample(logits, [SamplingParams(temperature=0)] * 16)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 49_152])
def test_greedy_ties_take_the_lowest_id(dtype: torch.dtype, vocab: int) -> None:
    """Ties everywhere (four distinct values): the lowest id of each row's maximum, as
    transformers' float32 argmax picks it, in the logits' own dtype and through the
    sampler's fast path and its general one (a masked row)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (32, vocab), generator=g).to(dtype)
    logits[0] = 1.0  # a row of one value: id 0
    expected = logits.float().argmax(dim=-1).tolist()
    assert expected[0] == 0 and len(set(expected)) > 1
    assert argmax(logits).tolist() == expected
    greedy = [SamplingParams(temperature=0)] * 32
    assert sample(logits, greedy).token_ids == expected
    masked = [()] * 31 + [(vocab + 1,)]  # an id beyond the vocabulary: the general path
    assert sample(logits, greedy, masked=masked).token_ids == expected


@pytest.mark.parametrize("temperature", [0.01, 0.7, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature: float) -> None:
    logits = random_logits(64, 50, seed=2)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 64
    assert sample(logits, params).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_mixed_with_random_rows_stay_argmax() -> None:
    logits = random_logits(10, 40, seed=3)
    params = [
        SamplingParams(temperature=0) if r % 2 else SamplingParams(temperature=2.0)
        for r in range(10)
    ]
    out = sample(logits, params)
    expected = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[r] for r in range(1, 10, 2)] == expected[1::2]


def test_tiny_top_p_is_argmax() -> None:
    logits = repeat(random_logits(1, 30, seed=4)[0], 500)
    out = sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 500)
    assert set(out.token_ids) == {int(logits[0].argmax())}


def test_tiny_temperature_does_not_overflow() -> None:
    logits = random_logits(8, 30, seed=5, scale=50.0)
    out = sample(logits, [SamplingParams(temperature=1e-30)] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize("temperature", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("seeded", [False, True])
def test_masked_tokens_are_never_chosen(temperature: float, seeded: bool) -> None:
    rows, vocab = 400, 12
    logits = random_logits(rows, vocab, seed=6)
    argmax = logits.argmax(dim=-1).tolist()
    # Always mask the argmax and one more token (sometimes an out-of-vocab id).
    masked = [(argmax[r], (r * 7) % vocab, vocab + 5) for r in range(rows)]
    keys = [sample_key(99 if seeded else None, r) for r in range(rows)]
    out = sample(logits, [SamplingParams(temperature=temperature)] * rows, keys, masked)
    for r, token in enumerate(out.token_ids):
        assert token not in masked[r]
    if temperature == 0:
        # Greedy picks the best unmasked token.
        blocked = logits.clone()
        for r in range(rows):
            blocked[r, list(masked[r][:2])] = -torch.inf
        assert out.token_ids == blocked.argmax(dim=-1).tolist()


def test_masking_does_not_modify_the_callers_logits() -> None:
    logits = random_logits(4, 10, seed=7)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=1.0)] * 4, masked=[(0, 1)] * 4)
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- top-k / top-p


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_never_samples_outside_the_top_k(k: int) -> None:
    draws, vocab = 4000, 40
    row = random_logits(1, vocab, seed=8, scale=1.0)[0]
    allowed = set(row.topk(k).indices.tolist())
    # A high temperature flattens the distribution so that tokens outside the top k
    # would be drawn often if top-k were not applied.
    out = sample(repeat(row, draws), [SamplingParams(temperature=5.0, top_k=k)] * draws)
    assert set(out.token_ids) == allowed  # never outside; every top-k token reachable


def test_top_k_ties_keep_the_lower_token_ids() -> None:
    logits = repeat(torch.zeros(10), 1000)
    out = sample(logits, [SamplingParams(top_k=3)] * 1000)
    assert set(out.token_ids) == {0, 1, 2}


def test_top_k_larger_than_vocab_is_no_op() -> None:
    logits = repeat(torch.zeros(5), 1000)
    out = sample(logits, [SamplingParams(top_k=50)] * 1000)
    assert set(out.token_ids) == set(range(5))


def test_top_p_never_samples_outside_the_nucleus() -> None:
    draws = 6000
    probs = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])
    logits = repeat(probs.log(), draws)
    out = sample(logits, [SamplingParams(top_p=0.5)] * draws)
    # Sorted: 0.3 (id 1), 0.25 (id 3), ...: 0.3 < 0.5 <= 0.55, so the nucleus is {1, 3}.
    counts = {t: out.token_ids.count(t) for t in set(out.token_ids)}
    assert set(counts) == {1, 3}
    # Renormalised inside the nucleus: P(1) = 0.3 / 0.55; 5 binomial standard deviations.
    p = 0.3 / 0.55
    assert abs(counts[1] - draws * p) < 5 * math.sqrt(draws * p * (1 - p))


def test_top_p_applies_after_top_k_and_temperature() -> None:
    draws = 3000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = repeat(probs.log(), draws)
    # top_k=2 renormalises to (4/7, 3/7); top_p=0.5 then keeps only token 0.
    out = sample(logits, [SamplingParams(top_k=2, top_p=0.5)] * draws)
    assert set(out.token_ids) == {0}
    # top_p=0.75 keeps {0, 1, 2} at temperature 1 (0.4 + 0.3 < 0.75 <= 0.9) but only
    # {0, 1} at temperature 0.5, which squares the probabilities to (16, 9, 4, 1) / 30
    # (16/30 < 0.75 <= 25/30): top-p sees the tempered distribution.
    out = sample(logits, [SamplingParams(temperature=0.5, top_p=0.75)] * draws)
    assert set(out.token_ids) == {0, 1}
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.75)] * draws)
    assert set(out.token_ids) == {0, 1, 2}


# --------------------------------------------------------------------------- distribution


def _assert_matches_softmax(token_ids: list[int], logits_row: torch.Tensor) -> None:
    """Every token's count within 5 standard deviations of its binomial expectation.

    A count of token i over N independent draws is Binomial(N, p_i), with standard
    deviation sqrt(N p_i (1 - p_i)) (at most 71, i.e. 0.35% in frequency, for N = 20000).
    Five standard deviations fail by chance with probability < 6e-7 per token (and the
    RNG is seeded anyway, so the test is deterministic). For ROW at N = 20000 a
    temperature 10% off (1.1 instead of 1) moves the most sensitive token by about 10
    standard deviations, and a dropped or extra token by far more, so such bugs fail.
    """
    n = len(token_ids)
    probs = logits_row.float().softmax(dim=-1).tolist()
    counts = [0] * len(probs)
    for token in token_ids:
        counts[token] += 1
    for token, p in enumerate(probs):
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[token] - n * p) <= 5 * sd + 1, (token, counts[token], n * p)


ROW = torch.tensor([4.0, 2.0, 1.0, 0.0, -1.0, -2.0, -4.0, 3.0])


def test_temperature_1_frequencies_match_softmax() -> None:
    draws = 20000
    out = sample(repeat(ROW, draws), [SamplingParams(temperature=1.0)] * draws)
    _assert_matches_softmax(out.token_ids, ROW)


def test_temperature_scales_the_logits() -> None:
    draws = 20000
    out = sample(repeat(ROW * 2, draws), [SamplingParams(temperature=2.0)] * draws)
    _assert_matches_softmax(out.token_ids, ROW)


def test_seeded_rows_frequencies_match_softmax() -> None:
    draws = 5000
    row = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    keys = [sample_key(7, i) for i in range(draws)]
    out = sample(repeat(row, draws), [SamplingParams(seed=7)] * draws, keys)
    _assert_matches_softmax(out.token_ids, row)


# --------------------------------------------------------------------------- seeds


def _seeded_run(
    target: SamplingParams,
    steps: list[torch.Tensor],
    companions: bool,
    dtype: torch.dtype,
    sample_index: int = 0,
) -> list[int]:
    """50 draws for one seeded row, alone or at a random position among random rows."""
    assert target.seed is not None
    others_rng = random.Random(42)
    tokens = []
    for step, step_logits in enumerate(steps):
        key = sample_key(target.seed, sample_index, step)
        rows = [(step_logits, target, key)]
        if companions:
            for _ in range(others_rng.randint(1, 12)):
                other = SamplingParams(
                    temperature=others_rng.choice([0.0, 0.3, 1.0, 2.0]),
                    top_k=others_rng.choice([0, 1, 3, 50]),
                    top_p=others_rng.choice([1.0, 0.9, 0.3]),
                    logprobs=others_rng.choice([None, 0, 5]),
                )
                gen = others_rng.choice([None, None, *(sample_key(s, 0, step) for s in range(5))])
                noise = torch.randn(step_logits.shape[0]) * others_rng.choice([0.1, 3.0])
                rows.append((noise, other, gen))
            others_rng.shuffle(rows)
        position = next(i for i, row in enumerate(rows) if row[1] is target)
        out = SAMPLER.sample(
            torch.stack([row[0] for row in rows]).to(dtype),
            [row[1] for row in rows],
            [row[2] for row in rows],
            [(3,) if others_rng.random() < 0.3 and i != position else () for i in range(len(rows))],
        )
        tokens.append(out.token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=123, temperature=1.0),
        SamplingParams(seed=2**63 - 1, temperature=0.8, top_k=20, top_p=0.9, logprobs=2),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_row_is_independent_of_its_batch(target: SamplingParams, dtype: torch.dtype) -> None:
    steps = list(random_logits(50, 64, seed=9, scale=1.0))
    alone = _seeded_run(target, steps, companions=False, dtype=dtype)
    assert alone == _seeded_run(target, steps, companions=False, dtype=dtype)
    torch.manual_seed(777)  # a different default-RNG state must not matter either
    batched = _seeded_run(target, steps, companions=True, dtype=dtype)
    assert batched == alone
    assert len(set(alone)) > 10  # really sampled, not argmax
    assert alone != [int(s.argmax()) for s in steps]


def test_sample_index_and_seed_select_distinct_streams() -> None:
    steps = list(torch.zeros(50, 64))  # uniform: the stream alone decides

    def run(seed: int, index: int) -> list[int]:
        return _seeded_run(
            SamplingParams(seed=seed),
            steps,
            companions=False,
            dtype=torch.float32,
            sample_index=index,
        )

    assert run(5, 0) == run(5, 0)
    assert run(5, 0) != run(5, 1)
    assert run(5, 1) != run(5, 2)
    assert run(5, 0) != run(6, 0)


def test_sample_key() -> None:
    assert sample_key(None, 0) is None
    keys = {sample_key(s, i, pos) for s in range(4) for i in range(4) for pos in range(4)}
    assert len(keys) == 64  # seed, sample index and position each select a stream
    assert all(key is not None and 0 <= key < 2**63 for key in keys)
    assert sample_key(3, 1, 2) == sample_key(3, 1, 2)


def test_keyed_draws_are_exponential() -> None:
    q = keyed_exponentials(torch.tensor([sample_key(1, 0), sample_key(2, 0)]), 50000)
    assert q.shape == (2, 50000)
    assert bool((q > 0).all()) and bool(torch.isfinite(q).all())
    for row in q:  # Exp(1): mean 1, P(q > 1) = 1/e, rows independent of each other
        assert abs(float(row.mean()) - 1.0) < 0.03
        assert abs(float((row > 1).float().mean()) - math.exp(-1)) < 0.01
    assert abs(float(torch.corrcoef(q)[0, 1])) < 0.02


def test_n_seeded_samples_of_one_request_differ() -> None:
    n, vocab = 4, 1000
    logits = repeat(torch.zeros(vocab), n)
    params = [SamplingParams(seed=11, n=n)] * n
    first = sample(logits, params, [sample_key(11, i) for i in range(n)])
    again = sample(logits, params, [sample_key(11, i) for i in range(n)])
    assert first.token_ids == again.token_ids
    assert len(set(first.token_ids)) == n


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_logits() -> None:
    rows, vocab = 6, 30
    logits = random_logits(rows, vocab, seed=10)
    params = [
        SamplingParams(temperature=0.7, top_k=3, logprobs=5),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.3, top_p=0.5, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, logprobs=20),
        SamplingParams(temperature=1.0, seed=3, logprobs=1),
    ]
    keys = [None, None, None, None, None, sample_key(3, 0)]
    out = sample(logits, params, keys)
    assert out.logprobs is not None
    expected = logits.log_softmax(dim=-1)
    for r, p in enumerate(params):
        entry = out.logprobs[r]
        if p.logprobs is None:
            assert entry is None
            continue
        assert entry is not None
        top = expected[r].topk(p.logprobs).indices.tolist() if p.logprobs else []
        assert set(entry) == {out.token_ids[r], *top}
        for token, value in entry.items():
            assert value == pytest.approx(float(expected[r, token]), abs=1e-5)
        assert next(iter(entry)) == out.token_ids[r]  # the sampled token comes first


def test_logprobs_none_when_not_requested() -> None:
    out = sample(random_logits(3, 10, seed=11), [SamplingParams()] * 3)
    assert out.logprobs == [None, None, None]


def test_logprobs_sampled_token_outside_the_top() -> None:
    # Flat high-temperature sampling over many rows: some sampled tokens are not in the
    # top 1, so their dict has 2 entries; the rest have 1.
    rows = 200
    logits = repeat(torch.linspace(0, 1, 20), rows)
    out = sample(logits, [SamplingParams(temperature=10.0, logprobs=1)] * rows)
    sizes = {len(entry) for entry in out.logprobs if entry is not None}
    assert sizes == {1, 2}


def test_logprobs_see_the_mask() -> None:
    logits = random_logits(1, 10, seed=12)
    masked = int(logits[0].argmax())
    out = sample(logits, [SamplingParams(temperature=0, logprobs=3)], masked=[(masked,)])
    assert out.logprobs is not None and out.logprobs[0] is not None
    assert masked not in out.logprobs[0]
    blocked = logits.clone()
    blocked[0, masked] = -torch.inf
    expected = blocked.log_softmax(dim=-1)[0]
    for token, value in out.logprobs[0].items():
        assert value == pytest.approx(float(expected[token]), abs=1e-5)


def test_bfloat16_logits() -> None:
    rows, vocab = 300, 50
    logits = random_logits(rows, vocab, seed=13).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.9, top_k=10, top_p=0.95, logprobs=3),
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=1.0, seed=1),
    ] * (rows // 3)
    keys = [sample_key(1, r) if r % 3 == 2 else None for r in range(rows)]
    out = sample(logits, params, keys)
    assert all(0 <= t < vocab for t in out.token_ids)
    assert out.token_ids[1::3] == logits.float().argmax(dim=-1).tolist()[1::3]
    expected = logits.float().log_softmax(dim=-1)
    assert out.logprobs is not None
    for r in range(0, rows, 3):
        entry = out.logprobs[r]
        assert entry is not None
        for token, value in entry.items():
            assert value == pytest.approx(float(expected[r, token]), abs=1e-5)


# --------------------------------------------------------------------------- edges


def test_empty_batch() -> None:
    out = SAMPLER.sample(torch.empty(0, 10), [], [], [])
    assert out.token_ids == [] and out.logprobs == []


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError, match="params"):
        SAMPLER.sample(torch.zeros(2, 5), [SamplingParams()], [None, None], [(), ()])
    with pytest.raises(ValueError, match="2-D"):
        SAMPLER.sample(torch.zeros(5), [SamplingParams()], [None], [()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_contract() -> None:
    cuda = torch.device("cuda")
    steps = random_logits(50, 64, seed=14, scale=1.0).to(cuda)
    target = SamplingParams(seed=9, temperature=0.8, top_k=20, top_p=0.9)

    def run(batch: bool) -> list[int]:
        tokens = []
        for position, step in enumerate(steps):
            gen = sample_key(9, 0, position)
            if batch:
                noise = torch.randn(7, 64, device=cuda)
                logits = torch.cat([noise[:3], step[None], noise[3:]])
                params = [SamplingParams(temperature=1.0, top_k=5)] * 3 + [target]
                params += [SamplingParams(temperature=0)] * 4
                gens = [None, None, None, gen, None, None, None, None]
                tokens.append(SAMPLER.sample(logits, params, gens, [()] * 8).token_ids[3])
            else:
                tokens.append(SAMPLER.sample(step[None], [target], [gen], [()]).token_ids[0])
        return tokens

    assert run(False) == run(True)
    # Keyed draws are the same numbers on either device.
    keys = torch.tensor([sample_key(9, 0, p) for p in range(4)])
    assert torch.equal(
        keyed_exponentials(keys.to(cuda), 1000).cpu(), keyed_exponentials(keys, 1000)
    )
    logits = random_logits(64, 100, seed=15).to(cuda, torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0)] * 64)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


def test_keyed_uniforms_stay_inside_the_open_interval() -> None:
    """The extreme hash values map strictly inside (0, 1), so q is never 0 (a token
    winning its draw whatever its probability) nor infinite."""
    u = open_unit(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64))
    assert bool((u > 0).all()) and bool((u < 1).all()), u.tolist()
    assert float(u[0]) == 0.5 / 2**23 and float(u[-1]) == 1 - 0.5 / 2**23


# --------------------------------------------------------------------------- no token to draw


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_row_with_nothing_to_draw_gets_no_token(logprobs: int | None) -> None:
    """Every token masked (here, or by allowed_token_ids against the mask), greedy or
    random, seeded or not: NO_TOKEN for that row, the other rows as without it."""
    vocab = 12
    logits = random_logits(5, vocab, seed=3)
    params = [
        SamplingParams(temperature=0.0, logprobs=logprobs),
        SamplingParams(temperature=0.8, logprobs=logprobs),
        SamplingParams(temperature=0.8, seed=5, logprobs=logprobs),
        SamplingParams(temperature=0.0, allowed_token_ids=(4,), logprobs=logprobs),
        SamplingParams(temperature=0.7, top_p=0.5, logprobs=logprobs),
    ]
    everything = list(range(vocab))
    masked = [everything, everything, everything, [4], [1]]
    out = sample(logits, params, [None, None, sample_key(5, 0, 9), None, None], masked)
    assert out.token_ids[:4] == [NO_TOKEN] * 4
    alone = sample(logits[4:], params[4:], None, masked[4:])
    assert out.token_ids[4] == alone.token_ids[0] not in (NO_TOKEN, 1)


def test_overflowed_logits_give_no_token_not_a_masked_one() -> None:
    """A repetition penalty that pushes a logit past float32 leaves nothing finite to
    draw: NO_TOKEN (before, the row drew token 0, masked or not)."""
    logits = torch.full((2, 8), -1.0)
    logits[:, 5] = 10.0  # / 1e-38: past float32
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1e-38, seed=1)
    history = History(np.array([5]), np.zeros(0, dtype=np.int64))
    for params in (penalised, SamplingParams(temperature=0.0, repetition_penalty=1e-38)):
        out = SAMPLER.sample(logits, [params] * 2, [sample_key(1, 0, 0)] * 2, [[0], [0]],
                             [history] * 2)  # fmt: skip
        assert out.token_ids == [NO_TOKEN, NO_TOKEN]


def test_float32_extremes_of_top_p_and_temperature_still_draw_allowed_tokens() -> None:
    """``top_p`` below float32's smallest value keeps the most likely token (it was cast
    to 0, which kept none); the largest temperature keeps masked tokens masked."""
    logits = random_logits(3, 16, seed=8)
    best = int(logits[0].argmax())
    tiny = SamplingParams(temperature=1.0, top_p=1e-46)
    assert sample(logits[:1], [tiny]).token_ids == [best]
    hot = SamplingParams(temperature=3.4e38, seed=2)
    for position in range(20):
        token = sample(logits[:1], [hot], [sample_key(2, 0, position)], [range(1, 16)]).token_ids
        assert token == [0]
