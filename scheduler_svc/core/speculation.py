"""Speculative decoding in the core: what a sequence proposes, and whether proposing pays.

A speculating decode schedules its last known token and ``k`` proposed ones in one
chunk; the workers compute all ``k + 1`` positions, draw the target model's token at
each (with the draw a plain decode would make there), and return the longest run of
proposals that equals those draws plus the draw after it (:mod:`ipc.plan_state`).
The output is therefore exactly what decoding without proposals gives, token for token
and, for a seeded request, draw for draw; a proposal only decides how many of those
tokens one step yields.

Proposals come from a :class:`Proposer`; :class:`PromptLookup` (n-gram matching over
the sequence's own tokens) is the one built in. Whether to propose at all is
:class:`SpeculationPolicy`'s call each step, from what it measured: the mean tokens a
proposal gains, and a fit of the workers' forward time against the tokens a step
computes. Proposing ``k`` more tokens for each of ``B`` sequences gains ``A`` tokens
each (``A``: accepted tokens per proposal) and costs ``b * k`` each (``b``: seconds per
token); one step of ``B`` decodes costs ``a + b * B``. It pays while ``A * (a + b * B) >
b * B * k``, i.e. at batch sizes below ``A * a / (b * (k - A))``. While it is off the
policy still speculates one step in :data:`PROBE_INTERVAL` to keep ``A`` current.
"""

from __future__ import annotations

from typing import Protocol

from scheduler_svc.core.ngram import NgramIndex
from scheduler_svc.core.request import Sequence

__all__ = ["PROBE_INTERVAL", "PromptLookup", "Proposer", "SpeculationPolicy"]

PROBE_INTERVAL = 32
"""While speculation does not pay, one step in this many speculates anyway (a measure
of the acceptance now: the text a batch generates changes)."""

MIN_VERIFIED = 16
"""Proposals verified before their gain may turn speculation off."""

_DECAY = 0.95
"""Weight of the past in each running mean (about the last 20 observations count)."""


class Proposer(Protocol):
    """Proposes the tokens that may follow a sequence (its known tokens only)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens; [] for none."""
        ...


class PromptLookup:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (:class:`~scheduler_svc.core.ngram.NgramIndex`, kept on
    the sequence and caught up with its tokens when it proposes)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        index = seq.ngram
        if index is None:
            index = seq.ngram = NgramIndex(min_n=self.min_n, max_n=self.max_n)
        token_ids = seq.token_ids
        if len(index.tokens) < len(token_ids):
            index.extend(token_ids[len(index.tokens) :])
        return index.propose(k)


class SpeculationPolicy:
    """Whether speculating pays this step, and the counts ``/metrics`` reports."""

    def __init__(self, num_speculative_tokens: int, *, backoff: bool = True) -> None:
        self.k = num_speculative_tokens
        self.backoff = backoff
        """False: every step may propose, whatever was measured."""
        self.num_drafts = 0
        """Proposals verified (one per sequence and step that proposed)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens
        """How often proposal ``i`` (0-based) of a proposal was accepted."""
        self.num_steps = 0
        """Steps planned with speculation allowed."""
        self._gain = _Mean()
        """Accepted tokens per proposal."""
        self._length = _Mean()
        """Tokens per proposal."""
        self._fit = _LinearFit()
        """Forward seconds against tokens computed, per step."""
        self._since_probe = 0

    def active(self, num_running: int) -> bool:
        """Whether this step's decodes may propose (``num_running`` sequences run)."""
        if not self.k:
            return False
        if not self.backoff or self._pays(num_running):
            self._since_probe = 0
            return True
        self._since_probe += 1
        if self._since_probe >= PROBE_INTERVAL:
            self._since_probe = 0
            return True
        return False

    def _pays(self, batch: int) -> bool:
        if self._gain.count < MIN_VERIFIED:
            return True  # too little measured yet: try
        gain = self._gain.value
        line = self._fit.line()
        if line is None:  # no timing (a fake worker), or one step size only
            return gain >= 0.5
        fixed, per_token = line
        if per_token <= 0:
            return gain > 0
        return gain * (fixed + per_token * batch) > per_token * batch * self._length.value

    def verified(self, num_draft: int, num_accepted: int) -> None:
        """A proposal of ``num_draft`` tokens came back with ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        for position in range(num_accepted):
            per_position[position] += 1
        self._gain.add(num_accepted)
        self._length.add(num_draft)

    def timed(self, num_tokens: int, forward_s: float) -> None:
        """A step computed ``num_tokens`` tokens in ``forward_s`` (0: not timed)."""
        if forward_s > 0 and num_tokens > 0:
            self._fit.add(num_tokens, forward_s)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens, since the start."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class _Mean:
    """An exponentially weighted mean."""

    __slots__ = ("count", "value")

    def __init__(self) -> None:
        self.count = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        weight = max(1 - _DECAY, 1 / self.count)
        self.value += weight * (x - self.value)


class _LinearFit:
    """Exponentially weighted least squares of ``y = a + b * x``."""

    __slots__ = ("n", "x", "xx", "xy", "y")

    def __init__(self) -> None:
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n = _DECAY * self.n + 1
        self.x = _DECAY * self.x + x
        self.y = _DECAY * self.y + y
        self.xx = _DECAY * self.xx + x * x
        self.xy = _DECAY * self.xy + x * y

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None while the x seen do not spread enough to fit a slope."""
        if self.n < 4:
            return None
        mean_x = self.x / self.n
        spread = self.xx / self.n - mean_x * mean_x
        if spread < 0.25:  # (the x are token counts)
            return None
        slope = (self.xy / self.n - mean_x * self.y / self.n) / spread
        return max(self.y / self.n - slope * mean_x, 0.0), slope
