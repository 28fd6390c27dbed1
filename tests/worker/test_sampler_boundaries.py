"""gpu_worker.sampler at the edges of its rules: top-p at exactly the nucleus mass,
ties, and rows whose parameters differ within one batch.

Written against the public call ``Sampler().sample(logits, params, keys, masked)``
with unseeded rows (``None``) and torch's default RNG fixed, or with sample keys.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gpu_worker.sampler import Sampler
from shared.sampling import SamplingParams

DRAWS = 600


@pytest.fixture(autouse=True)
def _fixed_default_rng() -> None:
    torch.manual_seed(20261130)


def draw(logits_row: list[float], params: SamplingParams, rows: int = DRAWS) -> Counter[int]:
    """Token counts over ``rows`` unseeded draws from one row of logits."""
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(rows, -1).contiguous()
    out = Sampler().sample(logits, [params] * rows, [None] * rows, [()] * rows)
    return Counter(out.token_ids)


@pytest.mark.parametrize(
    ("vocab", "top_p", "kept"),
    [
        (4, 0.5, 2),
        (4, 0.25, 1),
        (4, 0.75, 3),
        (2, 0.5, 1),
        (8, 0.5, 4),
        (64, 0.5, 32),
        (10, 0.7, 7),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_exactly_its_mass(
    vocab: int, top_p: float, kept: int
) -> None:
    # Uniform probabilities 1/vocab: the first `kept` tokens (ties go to the lower ids,
    # a stable sort) hold exactly top_p, so nothing after them may be drawn. The masses
    # are summed in float32 and compared with top_p in float32: 7 tenths reach 0.7.
    counts = draw([0.0] * vocab, SamplingParams(temperature=1.0, top_p=top_p))
    assert set(counts) == set(range(kept)), counts


def test_top_p_just_above_a_prefix_mass_keeps_one_more_token() -> None:
    counts = draw([0.0] * 4, SamplingParams(temperature=1.0, top_p=0.51))
    assert set(counts) == {0, 1, 2}, counts


def test_top_p_one_keeps_every_token() -> None:
    counts = draw([0.0] * 4, SamplingParams(temperature=1.0, top_p=1.0))
    assert set(counts) == {0, 1, 2, 3}, counts


def test_top_p_follows_the_probabilities_not_the_token_ids() -> None:
    # Probabilities 0.5, 0.25, 0.125, 0.125 on ids 3, 1, 0, 2: top_p 0.7 keeps 3 and 1.
    logits = [0.0, 1.0, 0.0, 2.0]
    counts = draw([x * 0.6931471805599453 for x in logits], SamplingParams(top_p=0.7))
    assert set(counts) == {1, 3}, counts
    assert counts[3] > counts[1]  # 2:1 odds over 600 draws


def test_top_k_and_top_p_rows_mixed_in_one_batch_keep_their_own_rules() -> None:
    rows = 300
    params = [
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0),
    ] * rows
    logits = torch.zeros(3 * rows, 4)
    out = Sampler().sample(logits, params, [None] * (3 * rows), [()] * (3 * rows))
    by_rule = [Counter(out.token_ids[i::3]) for i in range(3)]
    assert set(by_rule[0]) == {0, 1}
    assert set(by_rule[1]) == {0, 1, 2}
    assert set(by_rule[2]) == {0, 1, 2, 3}


def test_keyed_rows_honour_the_top_p_boundary_too() -> None:
    rows = 400
    logits = torch.zeros(rows, 4)
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=7)] * rows
    keys = list(range(1, rows + 1))
    out = Sampler().sample(logits, params, keys, [()] * rows)
    assert set(out.token_ids) == {0, 1}
    again = Sampler().sample(logits, params, keys, [()] * rows)
    assert again.token_ids == out.token_ids  # a key replays its draw


def test_temperature_zero_takes_the_lowest_of_tied_maxima_whatever_top_k() -> None:
    logits = [1.0, 5.0, 5.0, 0.0, 5.0]
    for params in (
        SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(temperature=0.0, logprobs=1),
    ):
        assert draw(logits, params, rows=50) == Counter({1: 50}), params


def test_greedy_rows_asking_for_logprobs_get_them() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]]).log_softmax(dim=-1)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=1)], [None], [()])
    assert out.token_ids == [1]
    assert out.logprobs[0] is not None
    assert out.logprobs[0] == pytest.approx({1: logits[0, 1].item()})


def test_top_k_ties_below_larger_values_keep_the_lower_ids() -> None:
    # top_k=3 keeps 7.0 and two of the four tied 3.0: ids 1 and 2 (the lower ones).
    logits = [7.0, 3.0, 3.0, 3.0, 3.0, 0.0]
    for temperature in (1.0, 30.0):
        counts = draw(logits, SamplingParams(temperature=temperature, top_k=3))
        assert set(counts) <= {0, 1, 2} and {1, 2} <= set(counts), counts


def test_top_k_rows_with_different_ties_in_one_batch() -> None:
    rows = 200
    batch = torch.tensor([[4.0, 4.0, 4.0, 0.0], [0.0, 9.0, 1.0, 1.0]] * rows)
    params = [SamplingParams(temperature=50.0, top_k=2), SamplingParams(temperature=50.0, top_k=3)]
    out = Sampler().sample(batch, params * rows, [None] * (2 * rows), [()] * (2 * rows))
    assert set(out.token_ids[0::2]) == {0, 1}
    assert set(out.token_ids[1::2]) == {1, 2, 3}


def test_tiny_temperatures_in_a_batch_of_differently_scaled_rows() -> None:
    # Each row is shifted by its own maximum before the division: a row far below
    # another one, or far above zero, still samples its own argmax (no inf or NaN).
    batch = torch.tensor([[0.0, 1.0, -3.0], [-1000.0, -900.0, -1000.5], [899.0, 900.0, 0.0]])
    params = [SamplingParams(temperature=1e-36)] * 3
    for _ in range(20):
        out = Sampler().sample(batch, params, [None] * 3, [()] * 3)
        assert out.token_ids == [1, 1, 1]


def test_masked_ids_at_or_past_the_vocabulary_are_ignored() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    out = Sampler().sample(logits, [greedy], [None], [(3, 4, 1)])
    assert out.token_ids == [2]


def test_keys_differing_in_any_bit_draw_different_streams() -> None:
    vocab = 32
    logits = torch.zeros(1, vocab)
    params = [SamplingParams(temperature=1.0, seed=0)]
    base = 0x1234_5678_9ABC_DEF0 >> 1
    draws = set()
    for flip in (0, 1 << 0, 1 << 16, 1 << 31, 1 << 32, 1 << 33, 1 << 48, 1 << 61):
        tokens = [
            Sampler().sample(logits, params, [base ^ flip ^ k], [()]).token_ids[0]
            for k in range(0, 64 << 34, 1 << 34)  # 64 keys apart in their high bits
        ]
        draws.add(tuple(tokens))
    assert len(draws) == 8
