"""What one step of the scheduler core produces besides the plan: the record of its
decisions (:class:`StepReport`), of what an update changed (:class:`UpdateOutcome`),
the plan under construction (:class:`StepBuilder`), a planned step waiting for its
result (:class:`InflightStep`), and the error for a result that does not answer its
plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.schema import BatchPlan, BlockUpdate, NewSeq
from scheduler_svc.core.kv_manager import CopyOnWrite
from scheduler_svc.core.policies import PreemptionMode
from scheduler_svc.core.request import Request, Sequence


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
    sampling: list[Sequence] = field(default_factory=list)
    """Scheduled sequences that sample a token (their last scheduled token is the last
    one they have, known or a placeholder)."""
    new_seqs: list[NewSeq] = field(default_factory=list)
    block_updates: list[BlockUpdate] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_samples: dict[str, int] = field(default_factory=dict)

    def add(
        self,
        seq: Sequence,
        num_new: int,
        appended: list[int],
        cow: CopyOnWrite | None,
    ) -> None:
        """Schedule ``num_new`` tokens of ``seq``, whose block table just grew by
        ``appended`` and, on a copy-on-write, had entry ``cow[0]`` copied from block
        ``cow[1]`` to ``cow[2]``: full data for a sequence the workers do not hold,
        block-table changes for one they do. The tokens count as computed from here on;
        one that reaches the end samples, and holds a placeholder until its result."""
        seq_id = seq.seq_id
        if cow is not None:
            self.copies.append((cow[1], cow[2]))
        if not seq.on_worker:
            self.new_seqs.append(
                NewSeq(
                    seq_id=seq_id,
                    request_id=seq.request.request_id,
                    sample_index=seq.sample_index,
                    token_ids=list(seq.token_ids),
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_computed_tokens=seq.num_computed_tokens,
                    block_ids=list(seq.block_table),
                    sampling=None if _params_on_worker(seq) else seq.request.params,
                )
            )
            seq.on_worker = True
        elif appended or cow is not None:
            self.block_updates.append(
                BlockUpdate(
                    seq_id=seq_id,
                    appended=appended,
                    replaced=[] if cow is None else [(cow[0], cow[2])],
                )
            )
        self.num_scheduled[seq_id] = num_new
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == len(seq.token_ids) + seq.num_placeholders:
            seq.num_placeholders += 1
            self.sampling.append(seq)
            if seq.pending_forks:
                self.num_samples[seq_id] = 1 + seq.pending_forks

    def plan(self, step: int, freed_seq_ids: list[str], *, reset: bool) -> BatchPlan:
        return BatchPlan(
            step=step,
            num_scheduled_tokens=self.num_scheduled,
            new_seqs=self.new_seqs,
            block_updates=self.block_updates,
            freed_seq_ids=freed_seq_ids,
            reset=reset,
            swap_out=self.swap_out,
            swap_in=self.swap_in,
            copies=self.copies,
            num_samples=self.num_samples,
        )


@dataclass(slots=True)
class InflightStep:
    """A planned step whose result has not been applied yet."""

    step: int
    scheduled: dict[str, int]
    """The plan's ``num_scheduled_tokens``: who runs in it."""
    sampling: list[Sequence]
    forks: bool
    """Whether it samples the forks of an n>1 request (nothing is planned past it)."""
    cpu_release: list[int] = field(default_factory=list)
    """CPU blocks of its swap-ins, released when its result arrives."""
    swapped_out: list[Sequence] = field(default_factory=list)
    """Sequences whose swap-out copies ride on it."""


def _params_on_worker(seq: Sequence) -> bool:
    """Whether the workers hold ``seq``'s request's sampling parameters: another of its
    sequences is on them (sent before, or earlier in this plan)."""
    return any(other.on_worker for other in seq.request.seqs if other is not seq)
