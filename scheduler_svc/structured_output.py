"""Structured output on llguidance: a request's :class:`~shared.structured_output.
StructuredOutput` compiled for the model's tokenizer, and per sample a matcher that
says which tokens may come next.

llguidance (guidance-ai's Rust grammar engine, vLLM's ``guidance`` backend) was chosen
over xgrammar for what this process split needs: it has no dependencies (xgrammar
brings torch, triton and transformers into the scheduler process, which must stay free
of torch), it fills bitmasks into numpy arrays, it takes JSON schemas, regular
expressions, Lark and llama.cpp's GBNF grammars, and it computes each mask lazily
(no grammar-wide precomputation to wait for, so a compile takes milliseconds).

The matchers live in the scheduler process, as vLLM's do: the core asks each
constrained sample that draws a token in a step for its mask (:meth:`Constraint.mask`:
one bit per token id, ``ceil(vocab / 32)`` little-endian int32 words, sent in the plan)
and hands it each token it accepts (:meth:`Constraint.accept`). A worker needs nothing
but the bits (``gpu_worker/token_bitmask.py``).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
from tokenizers import Tokenizer

from shared.errors import InvalidRequestError
from shared.structured_output import FIELD, StructuredOutput

if TYPE_CHECKING:
    from scheduler_svc.core.scheduler import Scheduler

__all__ = ["COMPILE_THREADS", "Constraint", "GrammarCompiler"]

COMPILE_NICE = 10
"""How much less CPU priority a compile thread has than the rest of the process."""


def _background_priority() -> None:
    """This thread at :data:`COMPILE_NICE` more niceness (Linux sets it per thread): a
    long compile takes the CPU the step loop and the worker leave, not theirs."""
    try:
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICE
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice))
    except (OSError, AttributeError):  # not Linux, or not allowed: the usual priority
        pass


COMPILE_THREADS = ThreadPoolExecutor(
    max_workers=2, thread_name_prefix="grammar", initializer=_background_priority
)
"""Where the daemon compiles (and builds its compiler): two threads at lower priority.
A flood of slow compiles queues here, each failing at its time limit, instead of
taking every core."""

_BOUNDED_WHITESPACE: dict[str, object] = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}
"""JSON whitespace between tokens: at most 24 characters in a row (room to indent a
deeply nested object; unbounded, a small model can emit newlines until max_tokens)."""
_COMPACT: dict[str, object] = {"whitespace_flexible": False}
"""``disable_any_whitespace``: none at all."""

_FORMATS = {"regex": "regex", "choice": "choice", "grammar": "grammar"}
"""Our kinds -> llguidance's grammar formats (``grammar``: Lark, or GBNF converted);
JSON schemas go through its JSON compiler."""


class Constraint:
    """One sample's matcher: the tokens it may draw next, advanced token by token."""

    __slots__ = ("matcher", "words")

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self.matcher = matcher
        self.words = words

    def mask(self) -> bytes:
        """The allowed next tokens: bit ``t % 32`` of int32 word ``t // 32`` set when
        token ``t`` may come next (after the end of a match: only the EOS tokens)."""
        bits = np.empty((1, self.words), dtype=np.int32)
        llg_numpy.fill_next_token_bitmask(self.matcher, bits, 0)
        return bits.tobytes()

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when it could not continue the match (the
        matcher is then in error and allows nothing)."""
        return bool(self.matcher.consume_token(token))

    def fork(self) -> Constraint:
        """A copy in the same state (a sample forked from this one)."""
        return Constraint(self.matcher.deep_copy(), self.words)

    @property
    def done(self) -> bool:
        """The match is complete and nothing may follow (or the matcher is in error)."""
        return bool(self.matcher.is_stopped() or self.matcher.is_error())

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a grammar too complex for the parser's limits, say),
        or None."""
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None


class GrammarCompiler:
    """Compiles constraints for one tokenizer; a cache of the last ``cache_size``
    grammars by their source (compiling is cheap, the tokenizer is not: built once)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        self.words = -(-self.vocab_size // 32)
        self.llg_tokenizer = llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(eos_token_ids) or None
        )
        self.cache: OrderedDict[tuple[str, str, bool], llguidance.LLMatcher] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        """Compiles run on threads (the daemon's), the cache is shared."""

    @classmethod
    def for_scheduler(cls, tokenizer: Tokenizer, scheduler: Scheduler) -> GrammarCompiler:
        """The compiler for the model ``scheduler`` serves: its vocabulary and EOS ids."""
        return cls(tokenizer, scheduler.vocab_size or 0, sorted(scheduler.eos_token_ids))

    def compile(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher for ``spec``; :class:`InvalidRequestError` naming
        ``structured_outputs`` and the problem when the library cannot take it."""
        key = (spec.kind, spec.source(), spec.disable_any_whitespace)
        with self.lock:
            prototype = self.cache.get(key)
            if prototype is not None:
                self.cache.move_to_end(key)
                return Constraint(prototype.deep_copy(), self.words)
        try:
            if spec.kind in ("json", "json_object"):
                options = _COMPACT if spec.disable_any_whitespace else _BOUNDED_WHITESPACE
                grammar = llguidance.LLMatcher.grammar_from_json_schema(key[1], overrides=options)
            else:
                grammar = llguidance.grammar_from(_FORMATS[spec.kind], key[1])  # type: ignore[arg-type]
        except ValueError as exc:
            raise InvalidRequestError(f"{FIELD}: {spec.kind}: {exc}", field=FIELD) from None
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            message = _first_line(matcher.get_error())
            raise InvalidRequestError(f"{FIELD}: {spec.kind}: {message}", field=FIELD)
        with self.lock:
            self.cache[key] = matcher
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return Constraint(matcher.deep_copy(), self.words)


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "rejected by the grammar compiler"
