"""A step of the scheduler core from its plan to its output.

A step is three values, as it crosses three owners: the plan the core makes
(:class:`~ipc.schema.BatchPlan`, :meth:`Scheduler.schedule`), the result the workers
return (:class:`~ipc.schema.StepResult`), and what the core made of it
(:class:`StepOutput`, :meth:`Scheduler.update`): the tokens, ends and logprobs the
output path turns into client messages, with the decisions of its planning and where
its time went, for the simulator, the tests and ``expeditor inspect``.

Between plan and result the step is an :class:`InflightStep` in ``Scheduler.inflight``,
the one queue of steps in flight: oldest first, popped by ``update()``, cleared by
``on_worker_lost()``. :class:`InflightStep` is also the plan under construction (what
``schedule()`` adds to it becomes the plan), what the core must apply or undo when the
result arrives or is lost, and the driver's handle on the result (its ``future``, set
by :class:`~scheduler_svc.step_engine.StepEngine`, which an executor that tracks its
steps reads back from there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipc.schema import BatchPlan, BlockUpdate, NewSeq, StepResult
from scheduler_svc.core.kv_manager import CopyOnWrite
from scheduler_svc.core.policies import PreemptionMode
from scheduler_svc.core.request import Request, Sequence
from shared.outputs import FinishReason, PromptLogprobs

if TYPE_CHECKING:
    from concurrent.futures import Future


class WorkerProtocolError(RuntimeError):
    """A step result that does not match the plan it answers."""


@dataclass(slots=True)
class StepOutput:
    """What one step produced: :meth:`Scheduler.update`'s return value, and what
    :meth:`StepEngine.step` returns (the output path's input).

    Ids and values as they were when the result was applied: the output path may
    process it while later steps change the sequences (a sequence's ids never change,
    so :attr:`tokens` reads them from the sequences only when asked)."""

    plan: BatchPlan
    preempted: list[tuple[str, PreemptionMode]]
    """Sequences its planning preempted, in order, and how."""
    swapped_in: list[str]
    prefix_hit_tokens: dict[str, int]
    """Sequence id -> prompt tokens found in the prefix cache, for those it admitted."""
    advanced: list[Sequence] = field(default_factory=list)
    """The sequences that got a token, in order (:attr:`tokens` has their ids)."""
    new_tokens: list[int] = field(default_factory=list)
    """The token each of :attr:`advanced` got."""
    finished_seqs: list[tuple[str, int, FinishReason]] = field(default_factory=list)
    """(request id, sample index, finish reason) of the samples it ended."""
    finished_requests: list[str] = field(default_factory=list)
    """Requests whose last sample it ended."""
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    """Index in :attr:`new_tokens` -> the logprobs of that token, where its request
    asked for them (a speculating sequence may get several tokens in one step)."""
    prompt_logprobs: list[tuple[str, PromptLogprobs]] = field(default_factory=list)
    """(request id, the prompt positions its step computed the logprobs of), where the
    request asked for them; a recomputed prefill repeats positions."""
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(request id, why) of requests ended because a sample could not go on: the worker
    could draw no token for it, or its structured-output matcher failed. Their samples
    end with ``abort``; the output path sends their clients the reason instead."""
    lost: bool = False
    """The workers lost the step (its result, if any, was dropped with the device
    cache): nothing above was applied, its requests were re-queued."""
    quarantined: list[Request] = field(default_factory=list)
    """Requests ended because steps holding them were lost twice (a lost step only)."""
    schedule_s: float = 0.0
    update_s: float = 0.0
    """Time in the core: ``schedule()``, and ``update()``."""
    execute_s: float = 0.0
    """From submitting the plan, or from the previous step's result when it was
    submitted ahead of it, to having its result (the worker's time included)."""
    planned_at: float = 0.0
    """``time.monotonic()`` when the plan was made (its new requests' queue time ends
    there); 0 = unknown, take ``time``."""
    time: float = 0.0
    """``time.monotonic()`` when its result was applied."""

    @property
    def tokens(self) -> list[tuple[str, int, str, int]]:
        """(request id, sample index, sequence id, new token), one a sequence that got
        one. Built on demand: ``update()`` only appends, which keeps it cheap."""
        return [
            (seq.request.request_id, seq.sample_index, seq.seq_id, token)
            for seq, token in zip(self.advanced, self.new_tokens, strict=True)
        ]


@dataclass(slots=True)
class InflightStep:
    """A step from planning until its result is applied (or lost).

    :meth:`add` builds the plan's parts while ``schedule()`` runs, :meth:`plan` makes
    the plan; then the step waits in ``Scheduler.inflight`` with what its result needs:
    the sequences that sample, the CPU blocks to release, the swap-outs riding on it."""

    step: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    """The plan's ``num_scheduled_tokens``: who runs in it."""
    sampling: list[Sequence] = field(default_factory=list)
    """Scheduled sequences that sample a token (their last scheduled token is the last
    one they have, known or a placeholder)."""
    new_seqs: list[NewSeq] = field(default_factory=list)
    block_updates: list[BlockUpdate] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)
    """Sequences whose swap-out copies ride on it."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    cpu_release: list[int] = field(default_factory=list)
    """CPU blocks of its swap-ins, released when its result arrives."""
    host_pins: list[int] = field(default_factory=list)
    """Host-tier blocks its swap-ins copy from, unpinned when its result arrives."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_samples: dict[str, int] = field(default_factory=dict)
    """Sequences that fork n>1 samples in it (nothing is planned past such a step)."""
    proposals: dict[str, list[int]] = field(default_factory=dict)
    """Speculating sequences' proposed tokens (nothing is planned past such a step)."""
    drafts: dict[str, int] = field(default_factory=dict)
    """Speculating sequences whose tokens the workers' draft model proposes: how many
    (the plan's ``draft_lengths``; nothing is planned past such a step either)."""
    chunked: bool = False
    """Some sequence computes a chunk of several known tokens in it (a prompt, a
    recompute): its time is not a decode step's (the speculation policy's fit)."""
    preempted: list[tuple[str, PreemptionMode]] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)
    output: StepOutput | None = None
    """Made with the plan; ``update()`` fills it in and returns it."""
    future: Future[StepResult] | None = None
    """The driver's: the executor's future of its result (``StepEngine``)."""
    submitted: float = 0.0
    """The driver's: ``time.perf_counter()`` when the plan was submitted."""

    def add(
        self,
        seq: Sequence,
        num_new: int,
        appended: list[int],
        cows: tuple[CopyOnWrite, ...],
        proposal: list[int] | None = None,
        drafted: int = 0,
    ) -> None:
        """Schedule ``num_new`` tokens of ``seq``, whose block table just grew by
        ``appended`` and, on each copy-on-write ``(index, source, private)`` of
        ``cows``, had entry ``index`` copied from block ``source`` to ``private``: full
        data for a sequence the workers do not hold, block-table changes for one they do.
        The tokens count as computed from here on; one that reaches the end samples, and
        holds a placeholder until its result.
        ``proposal``: the last ``len(proposal)`` of the ``num_new`` tokens are proposed
        ones (speculative decoding), known to the plan only; ``drafted``: the last
        ``drafted`` are the workers' draft model's, unknown until the result."""
        seq_id = seq.seq_id
        for _, source, private in cows:
            self.copies.append((source, private))
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
        elif appended or cows:
            self.block_updates.append(
                BlockUpdate(
                    seq_id=seq_id,
                    appended=appended,
                    replaced=[(index, private) for index, _, private in cows],
                )
            )
        self.num_scheduled[seq_id] = num_new
        seq.num_computed_tokens += num_new
        proposed = drafted
        if proposal:
            self.proposals[seq_id] = proposal
            proposed = len(proposal)
        elif drafted:
            self.drafts[seq_id] = drafted
        elif num_new > 1:
            self.chunked = True
        if seq.num_computed_tokens - proposed == len(seq.token_ids) + seq.num_placeholders:
            seq.num_placeholders += 1
            self.sampling.append(seq)
            if seq.pending_forks:
                self.num_samples[seq_id] = 1 + seq.pending_forks

    def plan(self, freed_seq_ids: list[str], *, reset: bool, masks: bool = False) -> BatchPlan:
        """The plan of what was added; makes the step's :attr:`output`. ``masks``: some
        sequences are constrained (the sampling ones' masks are then looked for)."""
        plan = BatchPlan(
            step=self.step,
            num_scheduled_tokens=self.num_scheduled,
            new_seqs=self.new_seqs,
            block_updates=self.block_updates,
            freed_seq_ids=freed_seq_ids,
            reset=reset,
            swap_out=self.swap_out,
            swap_in=self.swap_in,
            copies=self.copies,
            num_samples=self.num_samples,
            proposals=self.proposals,
            draft_lengths=self.drafts,
            token_masks={
                seq.seq_id: seq.constraint.mask()
                for seq in self.sampling
                if seq.constraint is not None
            }
            if masks
            else {},
        )
        self.output = StepOutput(plan, self.preempted, self.swapped_in, self.prefix_hit_tokens)
        return plan


def _params_on_worker(seq: Sequence) -> bool:
    """Whether the workers hold ``seq``'s request's sampling parameters: another of its
    sequences is on them (sent before, or earlier in this plan)."""
    return any(other.on_worker for other in seq.request.seqs if other is not seq)
