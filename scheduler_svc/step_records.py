"""What one step of the scheduler core produces besides the plan: the record of its
decisions (:class:`StepReport`), of what an update changed (:class:`UpdateOutcome`),
the plan under construction (:class:`StepBuilder`), and the error for a result that
does not answer its plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.schema import BlockUpdate, NewSeq
from scheduler_svc.policies import PreemptionMode
from scheduler_svc.request import Request, Sequence


class WorkerProtocolError(RuntimeError):
    """A step result that does not match the plan it answers."""


@dataclass(slots=True)
class StepReport:
    """What one :meth:`Scheduler.schedule` decided besides the plan itself."""

    step: int
    preempted: list[tuple[str, PreemptionMode]] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class UpdateOutcome:
    """What one :meth:`Scheduler.update` changed."""

    advanced: list[Sequence] = field(default_factory=list)
    """Sequences that got new tokens (their last ``len(tokens)`` entries)."""
    finished: list[Sequence] = field(default_factory=list)
    finished_requests: list[Request] = field(default_factory=list)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    """Sequence id -> logprobs of the token it got, where the request asked for them."""


@dataclass(slots=True)
class StepBuilder:
    """The parts of the plan under construction."""

    num_scheduled: dict[str, int] = field(default_factory=dict)
    inflight: list[tuple[Sequence, int]] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    block_updates: list[BlockUpdate] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_samples: dict[str, int] = field(default_factory=dict)
