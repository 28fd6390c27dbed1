"""Incremental detokenization for the scheduler daemon and ``LLM``.

On a ``tokenizers`` tokenizer (:func:`shared.tokenizer.load_tokenizer`, the checkpoint's
``tokenizer.json``), so the scheduler process never imports torch or transformers.
"""

from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, holding back incomplete UTF-8.

    Decodes only a short window (from ``prefix_offset``), so each step costs the
    window, not the whole output. Stop strings are searched in the new text plus the
    tail that could start a match.
    """

    WINDOW_TAIL = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        *,
        lazy: bool = False,
        keep_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """``lazy`` (no stop strings): nothing is decoded while tokens come in; the
        whole text is decoded once, by :meth:`flush` at the end. ``keep_stop``
        (``include_stop_str_in_output``): the text ends with the stop string found
        instead of before it. ``min_tokens``: stop strings are looked for only once
        there are more tokens than this (vLLM's rule), in the text the later tokens add
        (with the tail a match may start in)."""
        if lazy and stop:
            raise ValueError("a lazy detokenizer cannot look for stop strings")
        self.lazy = lazy
        self.keep_stop = keep_stop
        self.min_tokens = min_tokens
        self.tokenizer = tokenizer
        self.stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self._emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False
        self.stop_reason: str | None = None
        """The stop string that ended the text (the earliest match; first listed on a tie)."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; returns text now safe to show (may be empty).

        With stop strings, the last ``len(longest stop) - 1`` characters are held back
        until they cannot start a stop string; :meth:`flush` releases them at the end.
        After a stop string is found, ``stopped`` is set, ``text`` ends before it (with
        it, under ``keep_stop``), and later tokens are ignored.
        """
        window = self.push(token_id)
        if window is None:
            return ""
        return self.advance(self._decode(window[0]), self._decode(window[1]))

    def push(self, token_id: int) -> tuple[list[int], list[int]] | None:
        """First half of :meth:`add`: append the token and return the two token windows
        to decode (so a caller can decode many sequences' windows in one batch), or
        None once stopped."""
        if self.stopped:
            return None
        self.token_ids.append(token_id)
        if self.lazy:
            return None
        return (
            self.token_ids[self._prefix_offset : self._read_offset],
            self.token_ids[self._prefix_offset :],
        )

    def advance(self, prefix: str, full: str) -> str:
        """Second half of :meth:`add`, given the two windows decoded."""
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the rest
        delta = full[len(prefix) :]
        self._prefix_offset = max(self._read_offset - self.WINDOW_TAIL, 0)
        self._read_offset = len(self.token_ids)
        combined = self.text + delta
        if self.stop and len(self.token_ids) > self.min_tokens:
            start = max(len(self.text) - self._max_stop + 1, 0)
            found = [(i, s) for s in self.stop if (i := combined.find(s, start)) >= 0]
            if found:
                cut, self.stop_reason = min(found, key=lambda match: match[0])
                self.stopped = True
                self.text = combined[: cut + len(self.stop_reason) * self.keep_stop]
                return self.flush()
        self.text = combined
        safe_end = len(combined) - max(self._max_stop - 1, 0)
        if safe_end <= self._emitted:
            return ""
        emitted, self._emitted = self._emitted, safe_end
        return combined[emitted:safe_end]

    def flush(self) -> str:
        """Text not shown yet: held back for a possible stop string, or for an
        incomplete UTF-8 sequence that the end leaves incomplete (decoded as it stands,
        as a whole decode would), or all of it when lazy. Streamed deltas plus the flush
        therefore equal the text of the same request not streamed."""
        if self.lazy and self._read_offset < len(self.token_ids):
            self.text = self._decode(self.token_ids)
            self._read_offset = len(self.token_ids)
        elif not self.stopped and self._read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.token_ids)
        rest = self.text[self._emitted :]
        self._emitted = len(self.text)
        return rest
