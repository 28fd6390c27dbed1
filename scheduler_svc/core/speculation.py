"""Speculative decoding in the core: what a sequence proposes, and whether proposing pays.

A speculating decode schedules its last known token and ``k`` proposed ones in one
chunk; the workers compute all ``k + 1`` positions, draw the target model's token at
each (with the draw a plain decode would make there), and return the longest run of
proposals that equals those draws plus the draw after it (:mod:`ipc.plan_state`).
The output is therefore exactly what decoding without proposals gives, token for token
and, for a seeded request, draw for draw; a proposal only decides how many of those
tokens one step yields.

Proposals come from a :class:`Proposer` in this process; :class:`PromptLookup` (n-gram
matching over the sequence's own tokens) is the one built in. Or the workers draft them
(``Scheduler.drafting``: they run a draft model, ``speculative_model``): the plan then
carries only how many tokens each decode drafts (``BatchPlan.draft_lengths``), and the
result is checked against that length alone. How many tokens to propose is
:class:`SpeculationPolicy`'s call each step, from what it measured: how often a proposed
token at each position is accepted when those before it were, and a fit of the workers'
step time (forward and sampling) against the tokens a step computes, ``a + b * tokens``.
The ``j``-th proposed token of each of ``B`` decodes costs ``b`` to verify and yields a
token with the chance ``r_j`` that it is reached and accepted, a token a plain step of
``B`` decodes makes for ``(a + b * B) / B``; the policy proposes up to the last ``j``
with ``r_j * (a + b * B) / B > b`` (0: none this step). A batch large enough that the
fixed cost per sequence falls under the verification cost turns proposals off; while
they are off the policy still proposes ``k`` tokens after :data:`PROBE_INTERVAL` steps
to keep its measure current, and after twice as many each time that probe does not
turn them on again (up to :data:`MAX_PROBE_INTERVAL`): a draft model's probe costs a
catch-up of every context since its last draft.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ipc.schema import SeqStatus
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.ngram import NgramIndex
from scheduler_svc.core.request import Sequence
from scheduler_svc.core.step_records import InflightStep, StepOutput, WorkerProtocolError

__all__ = [
    "MAX_PROBE_INTERVAL",
    "MIN_VERIFIED",
    "PROBE_INTERVAL",
    "PromptLookup",
    "Proposer",
    "SpeculationPolicy",
    "SpeculativeSteps",
]

PROBE_INTERVAL = 32
"""While speculation does not pay, one step in this many speculates anyway (a measure
of the acceptance now: the text a batch generates changes)."""

MAX_PROBE_INTERVAL = 256
"""The interval doubles with each probe that leaves speculation off, up to this."""

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
    """How many tokens the decodes of this step may propose (0: none), from what was
    measured; and the counts ``/metrics`` reports."""

    def __init__(self, num_speculative_tokens: int, *, backoff: bool = True) -> None:
        self.k = num_speculative_tokens
        self.backoff = backoff
        """False: every step may propose ``k`` tokens, whatever was measured."""
        self.num_drafts = 0
        """Proposals verified (one per sequence and step that proposed)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens
        """How often proposal ``i`` (0-based) of a proposal was accepted."""
        self._accepts = [_Mean() for _ in range(num_speculative_tokens)]
        """Per position: how often a proposed token there was accepted when every one
        before it was (the chance a proposal goes on)."""
        self._fit = _LinearFit()
        """Decode steps' seconds (forward and sampling) against tokens computed."""
        self._since_probe = 0
        self._probe_interval = PROBE_INTERVAL

    def length(self, num_running: int, *, settled: bool = True) -> int:
        """Tokens each decode of this step may propose (``num_running`` sequences run).

        ``settled``: no step is in flight. A probe planned while one is proposes for
        no sequence with a token in flight; it stays due, and the next step (which
        waits for the results: a proposing step is not planned ahead) makes it."""
        if not self.k:
            return 0
        best = self._best_length(num_running) if self.backoff else self.k
        if best:
            self._since_probe = 0
            self._probe_interval = PROBE_INTERVAL
            return best
        self._since_probe += 1
        if self._since_probe >= self._probe_interval:
            if settled:
                self._since_probe = 0
                self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            return self.k
        return 0

    def _best_length(self, batch: int) -> int:
        """The longest proposal whose last token still pays: the chance it is reached
        and accepted, times what a token costs a plain decode step, beats what verifying
        it costs. Before enough is measured: ``k`` (try)."""
        if self.num_drafts < MIN_VERIFIED:
            return self.k
        line = self._fit.line()
        if line is None and self._fit.n:  # timed, but every step of one size (they all
            return 0  # speculate, a draft model's always k): a plain step gives the base
        if line is None:  # no timing (a fake worker)
            worth, cost = 1.0, 0.5  # a token must be accepted half the time
        else:
            fixed, per_token = line
            if per_token <= 0:
                return self.k
            batch = max(batch, 1)
            worth, cost = (fixed + per_token * batch) / batch, per_token
        reached = 1.0
        for position, accepts in enumerate(self._accepts):
            reached *= accepts.value if accepts.count else 1.0
            if reached * worth <= cost:
                return position
        return self.k

    def verified(self, num_draft: int, num_accepted: int) -> None:
        """A proposal of ``num_draft`` tokens came back with ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        for position in range(num_accepted):
            per_position[position] += 1
        accepts = self._accepts
        for position in range(num_accepted):
            accepts[position].add(1.0)
        if num_accepted < num_draft:
            accepts[num_accepted].add(0.0)

    def timed(self, num_tokens: int, seconds: float) -> None:
        """A step computed ``num_tokens`` tokens in ``seconds`` (0: not timed)."""
        if seconds > 0 and num_tokens > 0:
            self._fit.add(num_tokens, seconds)

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


class SpeculativeSteps:
    """The step's speculative part, a base of :class:`~scheduler_svc.core.scheduler.
    Scheduler` (as ``SequenceEnding`` is): a decode scheduled with its proposal, and
    its result applied over the accepted run; it works on the scheduler's state below."""

    kv: KVCacheManager
    proposer: Proposer
    drafting: bool
    speculation: SpeculationPolicy
    watermark_blocks: int
    _append_token: Callable[[Sequence, int, StepOutput, dict[int, float] | None], None]

    def _schedule_proposal(self, seq: Sequence, k: int, later: int, step: InflightStep) -> bool:
        """Schedule ``seq``'s decode with up to ``k`` of the proposer's tokens after it,
        within its request's setting, its length limit and the blocks beyond one for each
        of the ``later`` running sequences; False (nothing done) without a proposal that
        fits."""
        k = min(
            k,
            seq.request.num_speculative_tokens,
            seq.max_num_tokens - len(seq.token_ids) - 1,  # the tokens it may still get
        )
        if k <= 0:
            return False
        proposal = None if self.drafting else self.proposer.propose(seq, k)
        if proposal is not None and not proposal:
            return False
        num_new = 1 + (k if proposal is None else len(proposal))
        if not self.kv.can_append(seq, num_new, self.watermark_blocks + later * self.kv.num_groups):
            return False
        appended, cows = self.kv.append(seq, num_new)
        step.add(seq, num_new, appended, cows, proposal, 0 if proposal else k)
        return True

    def _accept(
        self,
        seq: Sequence,
        proposal: list[int] | int,
        tokens: list[int] | None,
        entries: list[dict[int, float]] | None,
        output: StepOutput,
    ) -> None:
        """Apply a speculating sequence's result: its accepted proposals and the token
        after them, up to the first that ends it; then only what they computed stays
        computed, and blocks past it go back to the pool. ``proposal``: the tokens
        proposed, or how many the workers drafted (their tokens unknown here)."""
        num_draft = proposal if isinstance(proposal, int) else len(proposal)
        if (
            not tokens
            or len(tokens) > num_draft + 1
            or (not isinstance(proposal, int) and tokens[:-1] != proposal[: len(tokens) - 1])
            or (entries is not None and len(entries) != len(tokens))
        ):
            raise WorkerProtocolError(
                f"{seq.seq_id}: tokens {tokens} do not answer the proposal {proposal}"
            )
        self.speculation.verified(num_draft, len(tokens) - 1)
        for position, token in enumerate(tokens):
            self._append_token(seq, token, output, entries[position] if entries else None)
            if seq.status is SeqStatus.FINISHED:
                return
        if seq.status is SeqStatus.RUNNING:
            seq.num_computed_tokens = len(seq.token_ids) - 1
            self.kv.truncate(seq, self.kv.blocks_for(seq.num_computed_tokens))
