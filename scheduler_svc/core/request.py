"""Requests and the sequences the scheduler moves between queues.

A request with ``n`` samples owns ``n`` sequences once its prompt is computed; before
that it has one (sample 0), and the others are forked from it, sharing its blocks.
Progress is tracked by counters only: a sequence needs work while
``num_computed_tokens < len(token_ids) + num_placeholders``, whether that is a fresh
prompt, a prompt chunk, the prompt after a prefix-cache hit, a recompute after
preemption, or the latest sampled token of a decode (known, or a placeholder for one a
step in flight samples).
"""

from __future__ import annotations

from typing import Protocol

from ipc.schema import ErrorCode, SeqStatus
from scheduler_svc.core.ngram import NgramIndex
from shared.outputs import FinishReason
from shared.sampling import SamplingParams

_NO_STOP_IDS: frozenset[int] = frozenset()

QueueKey = tuple[float, int, int] | tuple[float, int, int, int]
"""``(priority term, arrival number, sample index)``, or with fair share ``(priority
term, round, arrival number, sample index)``; one scheduler uses one shape only. See
``policies``."""


class TokenConstraint(Protocol):
    """A sample's structured-output matcher (``scheduler_svc/structured_output.py``):
    the core asks it for the mask of each token the sample draws and hands it each token
    it gets."""

    def mask(self) -> bytes:
        """Allowed next tokens: bit ``t % 32`` of little-endian int32 word ``t // 32``."""
        ...

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when it could not continue the match."""
        ...

    def fork(self) -> TokenConstraint:
        """A copy in the same state, for a forked sample."""
        ...

    @property
    def done(self) -> bool:
        """The match is complete: nothing may follow."""
        ...

    @property
    def error(self) -> str | None:
        """Why the matcher failed (it then allows nothing), or None."""
        ...


class RejectedError(Exception):
    """A request refused at submission; ``code`` is what its client gets in the
    ``ErrorReply`` (``BAD_REQUEST``, ``DUPLICATE``, ``REJECTED``: can never fit,
    ``OVERLOADED``: waiting queue full), the message says why; ``field``: the request
    field it names (as ``SamplingParams`` and ``Generate`` call it), when it names one."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class Request:
    """What a client submitted: the prompt, its sampling parameters and its samples."""

    __slots__ = (
        "arrival_seq",
        "arrival_step",
        "client",
        "fair_round",
        "finish_reason",
        "first_scheduled_step",
        "max_num_tokens",
        "max_output_tokens",
        "num_failed_steps",
        "num_speculative_tokens",
        "num_unfinished",
        "params",
        "priority",
        "prompt_token_ids",
        "request_id",
        "seqs",
        "stop_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        arrival_step: int,
        arrival_seq: int,
        max_output_tokens: int,
        client: str = "",
        eos_token_ids: frozenset[int] = _NO_STOP_IDS,
        max_model_len: int | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        self.arrival_step = arrival_step
        self.arrival_seq = arrival_seq
        self.max_output_tokens = max_output_tokens
        self.client = client
        """Who submitted it ("" = the one anonymous client); see ``FairShareRounds``."""
        self.fair_round = 0
        """Its fair-share round, set once by the scheduler at submission."""
        self.seqs: list[Sequence] = []
        self.num_unfinished = params.n
        self.num_speculative_tokens = num_speculative_tokens
        """Tokens its samples may propose per step (0: they never speculate)."""
        self.num_failed_steps = 0
        """Steps holding this request that a worker died in (see Scheduler.on_worker_lost)."""
        self.first_scheduled_step: int | None = None
        self.finish_reason: FinishReason | None = None
        # The stop rules in the form the per-token check reads (see Sequence.stop_ids);
        # the common case shares the scheduler's EOS set instead of building a new one.
        stop_ids = eos_token_ids if not params.ignore_eos else _NO_STOP_IDS
        if params.stop_token_ids:
            stop_ids = stop_ids | frozenset(params.stop_token_ids)
        self.stop_ids = stop_ids
        """Tokens that end a sample once it has more than ``min_tokens`` outputs."""
        max_num_tokens = len(prompt_token_ids) + max_output_tokens
        if max_model_len is not None:
            max_num_tokens = min(max_num_tokens, max_model_len)
        self.max_num_tokens = max_num_tokens
        """Length (prompt + output) at which a sample ends: max tokens or max_model_len."""

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def seq_id(self, sample_index: int) -> str:
        return self.request_id if self.params.n == 1 else f"{self.request_id}/{sample_index}"


class _SequenceHotFields:
    """The fields a decode step reads for every running sequence.

    CPython lays out a base class's slots before a subclass's (each group sorted by
    name), so keeping these here puts them next to the object header: a step touches
    two cache lines of each sequence instead of its whole object.
    """

    __slots__ = (
        "block_table",
        "constraint",
        "max_num_tokens",
        "num_computed_tokens",
        "num_placeholders",
        "on_worker",
        "pending_forks",
        "seq_id",
        "status",
        "stop_ids",
        "token_ids",
    )


class Sequence(_SequenceHotFields):
    """One sample of a request: its tokens, its progress and where its K/V live."""

    __slots__ = (
        "block_digests",
        "block_hashes",
        "cpu_block_table",
        "finish_reason",
        "key",
        "ngram",
        "num_bypassed",
        "num_cached_blocks",
        "num_preemptions",
        "num_prompt_tokens",
        "num_released",
        "released_width",
        "request",
        "sample_index",
    )

    def __init__(
        self,
        request: Request,
        sample_index: int,
        token_ids: list[int],
        key: QueueKey,
    ) -> None:
        self.request = request
        self.sample_index = sample_index
        self.seq_id = request.seq_id(sample_index)
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        """Tokens whose K/V are in the cache or are computed by a step in flight."""
        self.num_placeholders = 0
        """Tokens sampled by steps in flight whose ids are not back yet (overlapped
        scheduling): the next step may compute them already, the worker knows them."""
        self.block_table: list[int] = []
        self.cpu_block_table: list[int] = []
        self.block_hashes: list[int] = []
        """Chained content hashes of this sequence's full blocks, computed lazily."""
        self.block_digests: list[bytes] = []
        """Their prefix digests for the host tier (``host_tier.sequence_digests``)."""
        self.num_cached_blocks = 0
        """Leading blocks of ``block_table`` already registered in the prefix cache."""
        self.num_released = 0
        """Leading entries of ``block_table`` released because every layer's sliding
        window has passed them (they name the null block, see ``KVCacheManager.slide``)."""
        self.released_width = 1
        """Table entries a released block stands for: 1, or in a table of layer groups
        the windowed groups' (:mod:`scheduler_svc.core.kv_groups`)."""
        self.status = SeqStatus.WAITING
        self.key = key
        """Queue order (smaller runs first); static, see ``policies``."""
        self.num_preemptions = 0
        self.num_bypassed = 0
        """Times cache-aware admission admitted a later-queued sequence ahead of it."""
        self.pending_forks = 0
        """Samples still to fork from this one when its prompt completes (n>1)."""
        self.on_worker = False
        """Whether the workers hold state for it (else the next plan sends it in full)."""
        self.finish_reason: FinishReason | None = None
        self.stop_ids = request.stop_ids
        """Tokens that end it past ``min_tokens`` outputs (EOS unless ignored, stop ids)."""
        self.max_num_tokens = request.max_num_tokens
        """Its length limit: prompt + max output tokens, at most max_model_len."""
        self.ngram: NgramIndex | None = None
        """Its prompt-lookup index, made when it first proposes (speculative decoding)."""
        self.constraint: TokenConstraint | None = None
        """Its structured-output matcher, at its output so far (sample 0's is given with
        the request, a fork's copied from its parent's); it masks each token it draws."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_device_blocks(self) -> int:
        """Device blocks the sequence holds (its table less the released entries)."""
        return len(self.block_table) - self.num_released * self.released_width

    @property
    def slots_needed(self) -> int:
        """Running-sequence slots it takes once admitted, counting samples still to fork."""
        return 1 + self.pending_forks

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.value}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens}, blocks={self.block_table})"
        )
