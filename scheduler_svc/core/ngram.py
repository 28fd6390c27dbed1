"""Prompt lookup (n-gram) proposals for speculative decoding: the tokens that followed
the latest earlier occurrence of a sequence's last n tokens, in its prompt or output.

The lookup runs in the scheduler process, where the tokens are, with an index per
sequence kept as tokens are accepted: for each n in ``[min_n, max_n]``, n-gram ->
where its latest occurrence's continuation starts. Appending a token costs
``max_n - min_n + 1`` dictionary writes and a proposal as many lookups, whatever the
length of the sequence (a scan of the whole context per sequence and step would cost
milliseconds per sequence in Python at a few thousand tokens). The longest n that
matches wins; its proposal is the up to ``k`` tokens that followed it.

Only accepted tokens enter the index (a rejected proposal never does), so a rollback
needs nothing; a fork copies its parent's index (:meth:`NgramIndex.fork`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["NgramIndex"]


class NgramIndex:
    """One sequence's n-gram index over its tokens (prompt, then accepted outputs)."""

    __slots__ = ("min_n", "tables", "tokens")

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.tokens: list[int] = []
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        """``tables[n - min_n]``: n-gram -> the position its latest continuation starts."""
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append accepted tokens: each one is the continuation of the n-grams that end
        just before it."""
        own = self.tokens
        for token in tokens:
            position = len(own)
            for offset, table in enumerate(self.tables):
                n = self.min_n + offset
                if position >= n:
                    table[tuple(own[position - n : position])] = position
            own.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens after the latest earlier occurrence of the longest suffix
        of n tokens that occurred before; [] when none did."""
        own = self.tokens
        for offset in range(len(self.tables) - 1, -1, -1):
            # (a suffix as long as the sequence is in no table: nothing followed it)
            start = self.tables[offset].get(tuple(own[-(self.min_n + offset) :]))
            if start is not None:
                return own[start : start + k]
        return []

    def fork(self) -> NgramIndex:
        """An independent copy (an n>1 sample's)."""
        child = NgramIndex.__new__(NgramIndex)
        child.min_n = self.min_n
        child.tokens = list(self.tokens)
        child.tables = [dict(table) for table in self.tables]
        return child
