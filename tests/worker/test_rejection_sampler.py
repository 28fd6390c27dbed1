"""Speculative verification (``gpu_worker.rejection_sampler``): greedy rows emit exactly
greedy decoding's tokens; sampled rows emit tokens distributed as the target's own
(chi-square over tens of thousands of rows, for draft-model and certain n-gram
proposals, first and second emitted token); the same uniforms give the same tokens."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.rejection_sampler import verify_proposals

CHI2_CRITICAL = {4: 18.47}
"""Chi-square critical values at significance 0.001, by degrees of freedom (a correct
sampler fails one such check in a thousand; every draw below is seeded)."""


def emitted(accepted: torch.Tensor, tokens: torch.Tensor) -> list[list[int]]:
    return [tokens[r, : int(accepted[r]) + 1].tolist() for r in range(len(accepted))]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 5), k=st.integers(0, 4))
def test_greedy_rows_emit_greedy_decodings_tokens(seed: int, rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, k + 1, 7, generator=gen).softmax(dim=2)
    top = probs.argmax(dim=2)
    # proposals: the argmax, or (sometimes) another token
    wrong = torch.randint(0, 7, (rows, k), generator=gen)
    flip = torch.rand(rows, k, generator=gen) < 0.3
    proposals = torch.where(flip, wrong, top[:, :k])
    num_draft = torch.randint(0, k + 1, (rows,), generator=gen)
    accepted, tokens = verify_proposals(
        probs, proposals, num_draft, torch.ones(rows, dtype=torch.bool),
        torch.rand(rows, k, generator=gen), torch.rand(rows, k + 1, generator=gen),
    )  # fmt: skip
    for r, out in enumerate(emitted(accepted, tokens)):
        expected = []
        for j in range(int(num_draft[r]) + 1):
            expected.append(int(top[r, j]))
            if j == int(num_draft[r]) or int(proposals[r, j]) != int(top[r, j]):
                break
        assert out == expected


def chi2(counts: np.ndarray, expected_p: np.ndarray) -> float:
    expected = expected_p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run_sampled(certain: bool, seed: int, rows: int = 40_000) -> tuple[np.ndarray, list]:
    rng = np.random.default_rng(seed)
    k, vocab = 3, 5
    target = rng.dirichlet(np.ones(vocab), size=k + 1)  # one distribution per position
    draft = rng.dirichlet(np.ones(vocab) * 0.5, size=k)
    if certain:
        proposals = np.tile(rng.integers(0, vocab, size=k), (rows, 1))
    else:
        proposals = np.stack([rng.choice(vocab, size=rows, p=draft[j]) for j in range(k)], 1)
    num_draft = rng.integers(0, k + 1, size=rows)
    accepted, tokens = verify_proposals(
        torch.tensor(np.tile(target, (rows, 1, 1)), dtype=torch.float32),
        torch.tensor(proposals),
        torch.tensor(num_draft),
        torch.zeros(rows, dtype=torch.bool),
        torch.tensor(rng.random((rows, k)), dtype=torch.float32),
        torch.tensor(rng.random((rows, k + 1)), dtype=torch.float32),
        None if certain else torch.tensor(np.tile(draft, (rows, 1, 1)), dtype=torch.float32),
    )
    return target, [
        (int(n), out) for n, out in zip(num_draft, emitted(accepted, tokens), strict=True)
    ]


def test_sampled_rows_emit_the_targets_distribution() -> None:
    for certain, seed in ((False, 1), (True, 2)):
        target, outputs = run_sampled(certain, seed)
        first = np.bincount([out[0] for _, out in outputs], minlength=5)
        assert chi2(first, target[0]) < CHI2_CRITICAL[4], (certain, first)
        # the second token, wherever one was emitted: the target's at position 1
        second = np.bincount([out[1] for _, out in outputs if len(out) > 1], minlength=5)
        assert second.sum() > 5_000
        assert chi2(second, target[1]) < CHI2_CRITICAL[4], (certain, second)
        assert all(len(out) <= n + 1 for n, out in outputs)


def test_the_same_uniforms_give_the_same_tokens() -> None:
    _, once = run_sampled(False, 3, rows=500)
    _, again = run_sampled(False, 3, rows=500)
    assert once == again
