"""The worker half of the plan protocol: what a worker knows of each sequence, and
how one :class:`~ipc.schema.BatchPlan` changes it.

Plans are deltas (see :mod:`ipc.schema`), so a worker holds every sequence between
steps: its tokens, how many of them have K/V in the cache, its block table and its
sampling parameters (held once per request: a ``NewSeq`` without them takes those of
its request's other sequences). :meth:`WorkerState.apply` applies a plan's state
changes in the protocol's order, ``reset`` (forget everything), ``freed_seq_ids``,
``new_seqs``, ``block_updates``, then the scheduled token counts, and returns the
step's batch: which sequences run, at which positions, and how many tokens each
samples. After the forward the worker hands the sampled tokens to
:meth:`WorkerState.append_sampled`.

The protocol is strict: a plan that frees, updates or schedules a sequence the worker
does not hold, sends a :class:`~ipc.schema.NewSeq` for one it already holds, schedules
past a sequence's known tokens or asks for samples where none are due raises
:class:`WorkerStateError` (a scheduler bug; the state is then unspecified, and a
worker daemon reports the error and exits). The one case where a worker receives full
data for sequences it may still hold is after another worker was lost: the scheduler
requeues everything and resends it as ``NewSeq``, and marks that plan ``reset=True``
so a surviving worker drops its stale state first (a fresh one holds none).

No torch here: the fake worker of the simulator and the model runner share this code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ipc.schema import BatchPlan, NewSeq
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "Drafter",
    "ScheduledSeq",
    "WorkerSeq",
    "WorkerState",
    "WorkerStateError",
    "accepted_run",
]


def accepted_run(draws: list[int], proposal: list[int]) -> int:
    """How many of a speculating sequence's draws are its result: the draws at each
    position (after the known tokens, after the first proposed one, ...) while they equal
    the proposal, then the first that does not (or the one after all of it)."""
    accepted = 0
    while accepted < len(proposal) and draws[accepted] == proposal[accepted]:
        accepted += 1
    return accepted + 1


class Drafter(Protocol):
    """Proposes speculative tokens on the worker (a draft model; an EAGLE-style head
    would be one too): called by :meth:`WorkerState.apply` once the plan's block
    changes are applied and before the step's forward."""

    def draft(self, seqs: list[tuple[WorkerSeq, int]]) -> dict[str, list[int]]:
        """For each (sequence, k): exactly ``k`` tokens to follow its known ones, by
        sequence id. The sequence's table already holds blocks for all of them."""
        ...


class WorkerStateError(RuntimeError):
    """A plan that contradicts the worker's state (a scheduler/worker protocol bug)."""


@dataclass(slots=True)
class WorkerSeq:
    """One sequence as a worker holds it between steps."""

    seq_id: str
    request_id: str
    sample_index: int
    token_ids: list[int]
    """Prompt, then every output token known so far (sampled ones appended)."""
    num_prompt_tokens: int
    num_computed_tokens: int
    """Tokens whose K/V are in the cache (this step's scheduled ones included once
    :meth:`WorkerState.apply` returned)."""
    block_ids: list[int]
    sampling: SamplingParams

    banned_ids: np.ndarray | None = None
    """The ids masked while below ``min_tokens`` (stop ids and EOS, once each): built by
    the model runner the first time they are needed (the sampler skips those beyond the
    vocabulary)."""
    prompt_seen: np.ndarray | None = None
    """The prompt's distinct token ids, sorted: built by the model runner the first time
    a penalty needs them (the prompt never changes)."""

    @classmethod
    def from_new(cls, new: NewSeq, sampling: SamplingParams) -> WorkerSeq:
        return cls(
            seq_id=new.seq_id,
            request_id=new.request_id,
            sample_index=new.sample_index,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_computed_tokens=new.num_computed_tokens,
            block_ids=list(new.block_ids),
            sampling=sampling,
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens ``start..end-1`` are computed."""

    seq: WorkerSeq
    start: int
    num_tokens: int
    num_samples: int
    """0 unless the step reaches the end of the known tokens (a non-final prefill chunk
    samples nothing); then 1, or n on the step that forks an n>1 request."""
    num_proposed: int = 0
    """Of the tokens computed, the last ones that were proposed (speculative decoding):
    the model draws a token at each of the ``num_proposed + 1`` last positions."""

    @property
    def end(self) -> int:
        """Context length after the step: the positions attention reads."""
        return self.start + self.num_tokens

    @property
    def positions(self) -> range:
        return range(self.start, self.end)

    @property
    def sample_indices(self) -> list[int]:
        """The sample index of each token to draw: the sequence's own first, then the
        samples it forks (1..n-1; the parent of a fork is sample 0)."""
        if not self.num_samples:
            return []
        return [self.seq.sample_index, *range(1, self.num_samples)]


class WorkerState:
    """Every sequence a worker holds, updated plan by plan (``block_size``: tokens per
    KV block, by which a speculating sequence's table is cut back after its step;
    ``num_groups``: layer groups whose blocks a table holds side by side, see
    :mod:`scheduler_svc.core.kv_groups`)."""

    def __init__(self, block_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.seqs: dict[str, WorkerSeq] = {}
        self.params: dict[str, tuple[SamplingParams, int]] = {}
        """Request id -> its sampling parameters and how many held sequences use them."""
        self.proposals: dict[str, list[int]] = {}
        """The last applied plan's proposals: its own, or those its ``draft_lengths``
        asked the drafter for."""

    def get(self, seq_id: str) -> WorkerSeq:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise WorkerStateError(f"plan names unknown sequence {seq_id!r}")
        return seq

    def apply(self, plan: BatchPlan, drafter: Drafter | None = None) -> list[ScheduledSeq]:
        """Apply the plan's state changes; return its batch in plan order.

        Each scheduled sequence's ``num_computed_tokens`` already counts the step's
        tokens when this returns. The plan's ``draft_lengths`` are drafted by
        ``drafter`` (a plan with some and no drafter is an error); :attr:`proposals`
        holds the step's proposals then.
        """
        if plan.reset:
            self.seqs.clear()
            self.params.clear()
        freed_requests = []
        for seq_id in plan.freed_seq_ids:
            freed = self.seqs.pop(seq_id, None)
            if freed is None:
                raise WorkerStateError(f"plan frees unknown sequence {seq_id!r}")
            freed_requests.append(freed.request_id)
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise WorkerStateError(f"plan sends sequence {new.seq_id!r} again as new")
            self.seqs[new.seq_id] = WorkerSeq.from_new(new, self._hold(new))
        # Parameters are let go after the new sequences took theirs: a sequence sent
        # with a reference may name one its request's freed sequences held.
        for request_id in freed_requests:
            self._release(request_id)
        for update in plan.block_updates:
            seq = self.get(update.seq_id)
            seq.block_ids.extend(update.appended)
            for index, block in update.replaced:
                if not 0 <= index < len(seq.block_ids):
                    raise WorkerStateError(
                        f"{update.seq_id!r}: block {index} replaced in a table of "
                        f"{len(seq.block_ids)}"
                    )
                seq.block_ids[index] = block
        for seq_id in plan.num_samples:
            if seq_id not in plan.num_scheduled_tokens:
                raise WorkerStateError(f"plan samples unscheduled sequence {seq_id!r}")
        proposals = plan.proposals
        if plan.draft_lengths:
            proposals = {**proposals, **self._drafts(plan, drafter)}
        self.proposals = proposals
        for seq_id, proposal in proposals.items():
            seq = self.get(seq_id)
            self._check_proposal(plan, seq, len(proposal))
            seq.token_ids.extend(proposal)  # computed now, replaced by the result
        return [self._schedule(plan, seq_id, n) for seq_id, n in plan.num_scheduled_tokens.items()]

    def _check_proposal(self, plan: BatchPlan, seq: WorkerSeq, length: int) -> None:
        """A proposal of ``length`` tokens is scheduled as one decode's chunk."""
        scheduled = plan.num_scheduled_tokens.get(seq.seq_id, 0)
        if (
            not length
            or seq.seq_id in plan.num_samples
            or scheduled != 1 + length
            or seq.num_computed_tokens + 1 != len(seq.token_ids)
        ):
            raise WorkerStateError(
                f"{seq.seq_id!r}: a proposal of {length} tokens with {scheduled} "
                f"scheduled at {seq.num_computed_tokens} of {len(seq.token_ids)}"
            )

    def _drafts(self, plan: BatchPlan, drafter: Drafter | None) -> dict[str, list[int]]:
        """The drafter's tokens for the plan's ``draft_lengths``, checked."""
        if drafter is None:
            raise WorkerStateError("plan asks for drafted proposals; this worker has no drafter")
        asked = []
        for seq_id, k in plan.draft_lengths.items():
            seq = self.get(seq_id)
            if seq_id in plan.proposals:
                raise WorkerStateError(f"{seq_id!r}: both a proposal and a draft")
            self._check_proposal(plan, seq, k)
            asked.append((seq, k))
        drafted = drafter.draft(asked)
        for seq, k in asked:
            if len(drafted.get(seq.seq_id, ())) != k:
                raise WorkerStateError(f"{seq.seq_id!r}: the drafter did not draft {k} tokens")
        return drafted

    def _hold(self, new: NewSeq) -> SamplingParams:
        """The sampling parameters of ``new``'s request, now used by one more sequence."""
        held = self.params.get(new.request_id)
        sampling = new.sampling or (held[0] if held else None)
        if sampling is None:
            raise WorkerStateError(
                f"{new.seq_id!r}: sent without sampling parameters, and no sequence of "
                f"request {new.request_id!r} holds them"
            )
        self.params[new.request_id] = (sampling, 1 + (held[1] if held else 0))
        return sampling

    def _release(self, request_id: str) -> None:
        sampling, users = self.params[request_id]
        if users > 1:
            self.params[request_id] = (sampling, users - 1)
        else:
            del self.params[request_id]

    def _schedule(self, plan: BatchPlan, seq_id: str, num_tokens: int) -> ScheduledSeq:
        seq = self.get(seq_id)
        start = seq.num_computed_tokens
        known = len(seq.token_ids)
        if num_tokens < 1 or start + num_tokens > known:
            raise WorkerStateError(
                f"{seq_id!r}: {num_tokens} tokens scheduled at {start} of {known}"
            )
        seq.num_computed_tokens = start + num_tokens
        reaches_end = seq.num_computed_tokens == known
        num_samples = plan.num_samples.get(seq_id, 1) if reaches_end else 0
        if seq_id in plan.num_samples and (not reaches_end or num_samples < 1):
            raise WorkerStateError(
                f"{seq_id!r}: {plan.num_samples[seq_id]} samples asked at {start + num_tokens} "
                f"of {known} tokens"
            )
        proposal = self.proposals.get(seq_id) if self.proposals else None
        return ScheduledSeq(seq, start, num_tokens, num_samples, len(proposal or ()))

    def append_sampled(
        self,
        sampled: Mapping[str, list[int]],
        proposals: Mapping[str, list[int]] | None = None,
    ) -> None:
        """Append each sequence's own sampled token (the first; forked samples are new
        sequences the scheduler sends in a later plan); a speculating one's proposal
        (``proposals``) gives way to its tokens, the accepted proposals and the one
        after them, and only what those computed stays computed. A :data:`NO_TOKEN` is
        kept as token 0: the scheduler fails its request, but a step it planned before
        it knew (overlapped scheduling) still computes the position, and any id will do."""
        for seq_id, tokens in sampled.items():
            seq = self.get(seq_id)
            if seq.num_computed_tokens != len(seq.token_ids) or not tokens:
                raise WorkerStateError(f"{seq_id!r}: sampled a token where none was due")
            proposal = proposals.get(seq_id) if proposals else None
            if proposal is None:
                seq.token_ids.append(max(tokens[0], 0))  # NO_TOKEN (-1): 0
                continue
            del seq.token_ids[len(seq.token_ids) - len(proposal) :]
            seq.token_ids.extend(max(token, 0) for token in tokens)
            seq.num_computed_tokens = len(seq.token_ids) - 1
            keep = -(-seq.num_computed_tokens // self.block_size)  # blocks it fills
            del seq.block_ids[keep * self.num_groups :]
