"""A deterministic fake model and a fake worker that executes plans like a real one.

The fake model's next token is a pure function of (request, sample, output index), so
every sequence's correct output is known in advance whatever the batching, chunking,
prefix caching, preemption or forking (:meth:`FakeModel.reference_output`).

The fake worker applies plans to the model runner's sequence state
(:class:`ipc.plan_state.WorkerState`, with the same strict protocol checks) and keeps
a fake KV cache holding, per slot, the token (and layer group) whose K/V a real cache
would hold there.
It runs a plan's copies in the worker's order, writes each scheduled token into its
slot, and with ``verify_kv`` reads back every context slot the attention would read: a wrong
block table, a missing copy-on-write or a bad swap fails loudly with the position.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from ipc.plan_state import (
    Drafter,
    ScheduledSeq,
    WorkerSeq,
    WorkerState,
    WorkerStateError,
    accepted_run,
)
from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.request import Sequence
from shared.outputs import FinishReason
from shared.sampling import SamplingParams

_MASK = (1 << 64) - 1
EMPTY = -1
"""A fake cache slot never written."""


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class FakeModel:
    """Token ids ``FIRST_TOKEN..vocab_size-1`` from a hash; EOS only where told."""

    FIRST_TOKEN = 3

    def __init__(
        self,
        *,
        vocab_size: int = 32000,
        eos_token_id: int = 2,
        eos_at: Mapping[str, int] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_at = dict(eos_at or {})
        """request id -> 1-based index of the output token that is EOS."""
        self._seeds: dict[tuple[str, int], int] = {}

    def next_token(
        self, request_id: str, sample_index: int, num_output: int, min_tokens: int
    ) -> int:
        """The output token after ``num_output`` outputs (EOS is masked below min_tokens)."""
        if self.eos_at.get(request_id) == num_output + 1 and num_output >= min_tokens:
            return self.eos_token_id
        seed = self._seeds.get((request_id, sample_index))
        if seed is None:
            seed = self._seeds[(request_id, sample_index)] = zlib.crc32(
                f"{request_id}\0{sample_index}".encode()
            )
        span = self.vocab_size - self.FIRST_TOKEN
        return self.FIRST_TOKEN + _mix(seed * 1_000_003 + num_output) % span

    def prompt(self, request_id: str, length: int) -> list[int]:
        """A prompt of ``length`` tokens private to ``request_id``."""
        seed = zlib.crc32(f"prompt\0{request_id}".encode())
        span = self.vocab_size - self.FIRST_TOKEN
        return [self.FIRST_TOKEN + _mix(seed * 1_000_003 + i) % span for i in range(length)]

    def reference_output(
        self,
        request_id: str,
        sample_index: int,
        prompt_len: int,
        params: SamplingParams,
        max_model_len: int,
    ) -> tuple[list[int], FinishReason]:
        """The tokens and finish reason of this sample run alone, by the stop rules."""
        limit = min(params.max_tokens or max_model_len - prompt_len, max_model_len - prompt_len)
        out: list[int] = []
        while True:
            token = self.next_token(request_id, sample_index, len(out), params.min_tokens)
            out.append(token)
            stops = (token == self.eos_token_id and not params.ignore_eos) or (
                token in params.stop_token_ids
            )
            if len(out) > params.min_tokens and stops:
                return out, FinishReason.STOP
            if len(out) >= limit:
                return out, FinishReason.LENGTH


class FakeProposer:
    """Speculative decoding's proposals for the fake model: each proposed token is the
    model's own with probability ``acceptance`` (a pure function of the sequence and
    position, like the model), else a token it would not produce there; proposals have
    ``length`` tokens at most (None: as many as asked)."""

    def __init__(self, model: FakeModel, acceptance: float, length: int | None = None) -> None:
        self.model = model
        self.acceptance = acceptance
        self.length = length
        self.proposed = 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        request = seq.request
        k = k if self.length is None else min(k, self.length)
        return self._tokens(
            request.request_id, seq.sample_index, seq.seq_id, seq.num_output_tokens,
            request.params.min_tokens, k,
        )  # fmt: skip

    def draft(self, seqs: list[tuple[WorkerSeq, int]]) -> dict[str, list[int]]:
        """The same tokens drafted on the worker (:class:`ipc.plan_state.Drafter`):
        exactly ``k`` each."""
        drafts = {}
        for seq, k in seqs:
            drafts[seq.seq_id] = self._tokens(
                seq.request_id, seq.sample_index, seq.seq_id, seq.num_output_tokens,
                seq.sampling.min_tokens, k,
            )  # fmt: skip
        return drafts

    def _tokens(
        self,
        request_id: str,
        sample_index: int,
        seq_id: str,
        num_outputs: int,
        min_tokens: int,
        k: int,
    ) -> list[int]:
        model = self.model
        proposal: list[int] = []
        for offset in range(k):
            num_output = num_outputs + offset
            token = model.next_token(request_id, sample_index, num_output, min_tokens)
            draw = _mix(zlib.crc32(f"{seq_id}\0{num_output}".encode())) % 1000
            if draw >= self.acceptance * 1000:
                token = model.FIRST_TOKEN + (token + 1 - model.FIRST_TOKEN) % (
                    model.vocab_size - model.FIRST_TOKEN
                )
            proposal.append(token)
        self.proposed += len(proposal)
        return proposal


class FakeWorker:
    def __init__(
        self,
        model: FakeModel,
        *,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        verify_kv: bool = True,
        drafter: Drafter | None = None,
        window: int = 0,
        groups: tuple[int, ...] = (),
    ) -> None:
        """``drafter``: drafts the plans' ``draft_lengths`` (speculation drafted on the
        worker, as a draft model does); ``window``: every layer reads only the keys
        after position - window (a sliding window; the scheduler's ``kv_window``), so
        only those are verified, and the null block (the last) must never be written;
        ``groups``: the cache holds layer groups (their windows), each table their
        blocks side by side (:mod:`scheduler_svc.core.kv_groups`): every group stores
        each token, and a windowed group's keys are verified within its window only."""
        self.model = model
        self.drafter = drafter
        self.block_size = block_size
        self.verify_kv = verify_kv
        self.groups = groups or (window,)
        self.num_groups = len(self.groups)
        self.null_block = num_gpu_blocks - 1 if any(self.groups) else None
        # Per slot, the token and layer group whose K/V a real cache would hold there, as
        # one int (:meth:`_held`: the token itself in a cache of one group, so a step
        # stores the plan's own ints and allocates nothing).
        self.gpu_kv: list[int] = [EMPTY] * (num_gpu_blocks * block_size)
        self.cpu_kv: list[int] = [EMPTY] * (num_cpu_blocks * block_size)
        self.state = WorkerState(block_size, self.num_groups)
        self.swapped_blocks = 0

    @property
    def seqs(self) -> dict[str, WorkerSeq]:
        """The sequences the worker holds, by id."""
        return self.state.seqs

    def _copy(self, src: list[int], src_block: int, dst: list[int], dst_block: int) -> None:
        bs = self.block_size
        dst[dst_block * bs : (dst_block + 1) * bs] = src[src_block * bs : (src_block + 1) * bs]

    def _held(self, token: int, group: int) -> int:
        """What a slot holds for ``token``'s K/V in layer group ``group``."""
        groups = self.num_groups
        return token if groups == 1 else token * groups + group

    def _slot(self, seq: WorkerSeq, position: int, group: int = 0) -> int:
        bs = self.block_size
        index = position // bs * self.num_groups + group
        if index >= len(seq.block_ids):
            raise WorkerStateError(f"position {position} beyond the block table {seq.block_ids}")
        return seq.block_ids[index] * bs + position % bs

    def execute(self, plan: BatchPlan) -> StepResult:
        batch = self.state.apply(plan, self.drafter)
        proposals = self.state.proposals
        for gpu_block, cpu_block in plan.swap_out:
            self._copy(self.gpu_kv, gpu_block, self.cpu_kv, cpu_block)
        for cpu_block, gpu_block in plan.swap_in:
            self._copy(self.cpu_kv, cpu_block, self.gpu_kv, gpu_block)
        self.swapped_blocks += len(plan.swap_out) + len(plan.swap_in)
        for src, dst in plan.copies:
            self._copy(self.gpu_kv, src, self.gpu_kv, dst)

        # Forward: store every new token's K/V, then let attention read the contexts.
        for item in batch:
            for position in item.positions:
                for group in range(self.num_groups):
                    slot = self._slot(item.seq, position, group)
                    if slot // self.block_size == self.null_block:
                        raise WorkerStateError(f"position {position} stored in the null block")
                    self.gpu_kv[slot] = self._held(item.seq.token_ids[position], group)
        if self.verify_kv:
            for item in batch:
                self._verify(item.seq, item.start, item.end)

        sampled = {
            item.seq.seq_id: self._verified(item, proposals[item.seq.seq_id])
            if item.num_proposed
            else [
                self.model.next_token(
                    item.seq.request_id,
                    index,
                    item.seq.num_output_tokens,
                    item.seq.sampling.min_tokens,
                )
                for index in item.sample_indices
            ]
            for item in batch
            if item.num_samples
        }
        self.state.append_sampled(sampled, proposals)
        return StepResult(step=plan.step, sampled_token_ids=sampled)

    def _verified(self, item: ScheduledSeq, proposal: list[int]) -> list[int]:
        """A speculating sequence's tokens: the model's at each position, cut to the
        accepted run as the model runner cuts them."""
        seq = item.seq
        known_outputs = seq.num_output_tokens - len(proposal)
        draws = [
            self.model.next_token(
                seq.request_id, seq.sample_index, known_outputs + position, seq.sampling.min_tokens
            )
            for position in range(len(proposal) + 1)
        ]
        return draws[: accepted_run(draws, proposal)]

    def _verify(self, seq: WorkerSeq, start: int, context_len: int) -> None:
        """The keys the step's queries (positions ``start..context_len-1``) read."""
        kv = self.gpu_kv
        for group, window in enumerate(self.groups):
            first = max(0, start - window + 1) if window else 0
            for position in range(first, context_len):
                held = kv[self._slot(seq, position, group)]
                if held != self._held(seq.token_ids[position], group):
                    raise WorkerStateError(
                        f"{seq.request_id}/{seq.sample_index}: KV at position {position} "
                        f"(group {group}) holds {self._describe(held)}, expected token "
                        f"{seq.token_ids[position]} (blocks {seq.block_ids})"
                    )

    def _describe(self, held: int) -> str:
        groups = self.num_groups
        if held == EMPTY:
            return "nothing"
        if groups == 1:
            return f"token {held}"
        return f"token {held // groups} of group {held % groups}"
