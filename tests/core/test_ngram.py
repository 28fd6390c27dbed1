"""Prompt lookup proposals (``scheduler_svc.core.ngram``) against a plain scan of the
whole context, over Hypothesis-drawn token sequences grown in random pieces; forks are
independent."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core.ngram import NgramIndex


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The reference: the longest n whose last-n suffix occurred earlier (followed by
    at least one token); the k tokens after its latest such occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=5),
    k=st.integers(1, 6),
    sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)),
)
def test_proposals_match_a_scan_of_the_context(
    tokens: list[int], cuts: list[int], k: int, sizes: tuple[int, int]
) -> None:
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    index = NgramIndex(min_n=min_n, max_n=max_n)
    for low, high in itertools.pairwise(bounds):
        index.extend(tokens[low:high])
        assert index.propose(k) == scan(tokens[:high], k, min_n, max_n)
    assert index.tokens == tokens


def test_a_repeated_phrase_is_proposed_and_forks_are_independent() -> None:
    text = [7, 1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    index = NgramIndex(text, min_n=1, max_n=3)
    assert index.propose(2) == [4, 5]  # "1 2 3" was followed by "4 5"
    child = index.fork()
    child.extend([8])
    assert child.propose(3) == [] and index.propose(3) == [4, 5, 9]
    assert index.tokens == text and child.tokens == [*text, 8]
    assert NgramIndex([1, 2, 3]).propose(4) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n=3, max_n=2)


def test_the_default_sizes_are_one_to_four() -> None:
    """A lone repeated token is proposed from (min_n 1); of two earlier matches the
    latest 4-gram wins over an older 5-gram (max_n 4)."""
    assert NgramIndex([5, 9, 5]).propose(2) == [9, 5]
    tokens = [1, 2, 3, 4, 5, 7, 9, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5]
    assert NgramIndex(tokens).propose(1) == [8]
    assert NgramIndex(tokens, max_n=5).propose(1) == [7]
