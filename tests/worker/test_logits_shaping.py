"""gpu_worker.logits_shaping and min-p against references written here from vLLM's
definitions (``vllm/sampling_params.py`` and its sampler), logits in, logits out, over
Hypothesis-drawn batches mixing the controls row by row."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.logits_shaping import History, bad_word_bans, shape_logits, shaping_arrays
from gpu_worker.sampler import Sampler, sample_key
from shared.sampling import SamplingParams


def reference(logits: list[float], p: SamplingParams, history: History | None) -> list[float]:
    """One row by vLLM's definitions: allowed tokens, logit bias, then the repetition
    penalty over prompt and output tokens, frequency and presence over the output."""
    x = list(logits)
    vocab = len(x)
    if p.allowed_token_ids:
        x = [v if i in p.allowed_token_ids else -math.inf for i, v in enumerate(x)]
    for token, bias in p.logit_bias:  # type: ignore[union-attr]
        if token < vocab:
            x[token] += bias
    if history is not None and p.penalised:
        output = [int(t) for t in history.output]
        seen = set(output) | {int(t) for t in history.prompt}
        for i in range(vocab):
            if i in seen:
                x[i] = x[i] / p.repetition_penalty if x[i] > 0 else x[i] * p.repetition_penalty
            count = output.count(i)
            x[i] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


@st.composite
def rows(draw: st.DrawFn, vocab: int) -> tuple[SamplingParams, History | None]:
    ids = st.integers(0, vocab + 3)  # ids past the vocabulary are ignored
    fields: dict[str, object] = {}
    if draw(st.booleans()):
        inside = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6)  # one at least
        fields["allowed_token_ids"] = draw(inside) + draw(st.lists(ids, max_size=2))
    if draw(st.booleans()):
        bias = st.floats(-100, 100, allow_nan=False)
        fields["logit_bias"] = draw(st.dictionaries(ids, bias, max_size=5))
    penalty = st.floats(-2, 2, allow_nan=False)
    if draw(st.booleans()):
        fields["presence_penalty"] = draw(penalty)
    if draw(st.booleans()):
        fields["frequency_penalty"] = draw(penalty)
    if draw(st.booleans()):
        fields["repetition_penalty"] = draw(st.floats(0.1, 3.0))
    p = SamplingParams(**fields)  # type: ignore[arg-type]
    history = None
    if p.penalised or draw(st.booleans()):
        prompt = draw(st.lists(ids, min_size=1, max_size=12))
        output = draw(st.lists(ids, max_size=12))
        history = History(np.array(prompt, dtype=np.int64), np.array(output, dtype=np.int64))
    return p, history


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams], list[History | None]]:
    vocab = draw(st.integers(4, 24))
    drawn = draw(st.lists(rows(vocab), min_size=1, max_size=6))
    values = st.floats(-20, 20, allow_nan=False, width=32)
    logits = torch.tensor(draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab),
                                        min_size=len(drawn), max_size=len(drawn))))  # fmt: skip
    return logits, [p for p, _ in drawn], [h for _, h in drawn]


def shaped(logits: torch.Tensor, params: list[SamplingParams], histories: list) -> torch.Tensor:
    arrays = shaping_arrays(params, histories, logits.shape[1])
    return shape_logits(logits, {k: torch.from_numpy(v) for k, v in arrays.items()})


@settings(max_examples=200, deadline=None)
@given(batches())
def test_shaping_equals_the_reference_row_by_row(batch: tuple) -> None:
    logits, params, histories = batch
    before = logits.clone()
    out = shaped(logits, params, histories)
    assert torch.equal(logits, before)  # the caller's tensor is left alone
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        expected = torch.tensor(reference(logits[r].tolist(), p, h))
        torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-4)
        if not p.shapes_logits:
            assert torch.equal(out[r], logits[r])  # untouched, bit for bit


@settings(max_examples=100, deadline=None)
@given(batches())
def test_the_sampler_picks_from_the_shaped_logits(batch: tuple) -> None:
    """Greedy rows take the argmax of the reference's logits; logprobs are its
    log-softmax (the sampler's documented order: after shaping, before temperature)."""
    logits, params, histories = batch
    params = [SamplingParams(**{**_fields(p), "temperature": 0.0, "logprobs": 3}) for p in params]
    out = Sampler().sample(logits, params, [None] * len(params), [()] * len(params), histories)
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        expected = torch.tensor(reference(logits[r].tolist(), p, h))
        top = expected.max()
        assert expected[out.token_ids[r]] == top  # an argmax (ties: any of them)
        log_probs = expected.log_softmax(-1)
        for token, value in out.logprobs[r].items():  # type: ignore[union-attr]
            assert value == pytest.approx(float(log_probs[token]), abs=1e-4)


def _fields(p: SamplingParams) -> dict[str, object]:
    return {name: getattr(p, name) for name in p.__struct_fields__}


def test_greedy_rows_without_logprobs_are_shaped_too() -> None:
    """The sampler's one-argmax fast path is only for rows nothing shapes; controls that
    need no history (bias, allowed tokens) need no histories argument."""
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0], [5.0, 1.0, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, logit_bias={0: -10.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=(2, 3), logit_bias={3: 1.0}),
    ]
    out = Sampler().sample(logits, params, [None, None], [(), ()])
    assert out.token_ids == [1, 3]


def test_penalties_need_a_history() -> None:
    with pytest.raises(ValueError, match="no history"):
        shaping_arrays([SamplingParams(presence_penalty=1.0)], [None], 10)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    history = History(np.array([0]), np.array([1]))
    out = shaped(logits, [SamplingParams(repetition_penalty=2.0)], [history])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]
    out = shaped(logits, [SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)],
                 [History(np.array([0]), np.array([2, 2, 3]))])  # fmt: skip
    assert out.tolist() == [[2.0, -2.0, 2.0 - 1.0 - 1.0, -2.0 - 0.5 - 1.0]]


def test_bad_word_bans() -> None:
    words = [(7,), (1, 2), (3, 4, 5)]
    assert bad_word_bans(words, []) == [7]
    assert bad_word_bans(words, [9, 1]) == [7, 2]
    assert bad_word_bans(words, [3, 4]) == [7, 5]
    assert bad_word_bans(words, [3, 4, 1]) == [7, 2]
    assert bad_word_bans(words, [4]) == [7]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=3, max_size=20),
    st.floats(0.01, 0.9),
    st.floats(0.3, 2.0),
    st.integers(0, 2**32),
)
def test_min_p_never_samples_a_token_below_its_threshold(
    values: list[float], min_p: float, temperature: float, seed: int
) -> None:
    """vLLM: after temperature, tokens whose probability is below min_p times the most
    likely one's are dropped (tokens near the threshold are left out of the check)."""
    logits = torch.tensor([values])
    probs = (logits / temperature).softmax(-1)[0]
    ratio = probs / probs.max()
    p = SamplingParams(min_p=min_p, temperature=temperature, seed=seed)
    rows = 16
    out = Sampler().sample(
        logits.expand(rows, -1), [p] * rows, [sample_key(seed, i) for i in range(rows)],
        [()] * rows,
    )  # fmt: skip
    for token in out.token_ids:
        assert ratio[token] >= min_p * (1 - 1e-4), (token, float(ratio[token]), min_p)
