"""Every message that crosses a process boundary, as tagged frozen msgspec Structs.

Encoding is msgpack through :func:`encode` / :func:`decode`; nothing on the wire is
pickled. A decoder only accepts the message types listed in :data:`Message`, so a
malformed or unexpected frame fails with a ``msgspec.DecodeError`` / ``ValidationError``
instead of reaching application code.

Plans are deltas: a sequence the worker has no state for (new, resumed after swap or
recompute, or just forked from its n>1 parent) is sent in full as :class:`NewSeq`;
a sequence the worker already knows only sends its block-table changes
(:class:`BlockUpdate`) and its token count in ``num_scheduled_tokens``. Tokens the
worker itself sampled are never sent back to it.

A worker executes one plan in this order: ``swap_out`` (device -> CPU pool),
``swap_in`` (CPU pool -> device), ``copies`` (copy-on-write, device -> device), then
one forward over every sequence in ``num_scheduled_tokens``, in that order. Within a
layer all new K/V are stored before any attention reads, so a sequence may read blocks
that another sequence of the same step writes (identical prompts admitted together).
"""

from __future__ import annotations

import msgspec

from shared.sampling import SamplingParams

__all__ = [
    "BatchPlan",
    "BlockUpdate",
    "BlockUsage",
    "Message",
    "NewSeq",
    "PrefixCacheStats",
    "SchedulerSnapshot",
    "SeqInfo",
    "StepResult",
    "StepTiming",
    "WorkerHello",
    "decode",
    "encode",
]


class NewSeq(msgspec.Struct, frozen=True, kw_only=True):
    """Full data for a sequence the worker holds no state for."""

    seq_id: str
    request_id: str
    sample_index: int
    token_ids: list[int]
    """Prompt followed by every output token known so far."""
    num_prompt_tokens: int
    num_computed_tokens: int
    """Tokens whose K/V are already in the cache (prefix hit, swap-in, fork)."""
    block_ids: list[int]
    """The whole device block table after this step's allocations."""
    sampling: SamplingParams


class BlockUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """Block-table change of a sequence the worker already knows."""

    seq_id: str
    appended: list[int] = []
    replaced: list[tuple[int, int]] = []
    """(index in the table, new block id): copy-on-write replacements."""


class BatchPlan(msgspec.Struct, frozen=True, kw_only=True, tag="plan", tag_field="type"):
    """One step of work for the workers: exactly one batched forward."""

    step: int
    num_scheduled_tokens: dict[str, int]
    """Every sequence that runs this step -> new tokens it computes, in batch order."""
    new_seqs: list[NewSeq] = []
    block_updates: list[BlockUpdate] = []
    freed_seq_ids: list[str] = []
    """Sequences finished, aborted or preempted since the last plan: drop their state."""
    swap_out: list[tuple[int, int]] = []
    """(device block, CPU pool block) copies, done first."""
    swap_in: list[tuple[int, int]] = []
    """(CPU pool block, device block) copies, done after swap_out."""
    copies: list[tuple[int, int]] = []
    """(source device block, destination device block) copy-on-write, done before the forward."""
    num_samples: dict[str, int] = {}
    """Sequences that must return more than one sampled token (the n>1 fork step)."""

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class StepTiming(msgspec.Struct, frozen=True, kw_only=True):
    swap_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    total_s: float = 0.0


class StepResult(msgspec.Struct, frozen=True, kw_only=True, tag="result", tag_field="type"):
    """What the worker sampled in one step.

    Only sequences whose scheduled tokens reached the end of their known tokens are
    sampled (a non-final prefill chunk produces nothing).
    """

    step: int
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]] | None = None
    """Per sequence, per sampled token: token id -> logprob (sampled + top-k)."""
    timing: StepTiming = StepTiming()


class WorkerHello(msgspec.Struct, frozen=True, kw_only=True, tag="hello", tag_field="type"):
    """First message of a worker: what it can hold; the scheduler sizes its budget from it."""

    rank: int
    pid: int
    device: str
    num_gpu_blocks: int
    kv_bytes_per_block: int
    block_size: int
    model: str
    eos_token_id: int | None = None


class BlockUsage(msgspec.Struct, frozen=True, kw_only=True):
    total: int
    free: int
    """Blocks with refcount zero, prefix-cached or not."""
    cached: int = 0
    """Of the free blocks, those still holding a reusable prefix."""


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    queried_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class SeqInfo(msgspec.Struct, frozen=True, kw_only=True):
    seq_id: str
    request_id: str
    state: str
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_preemptions: int


class SchedulerSnapshot(
    msgspec.Struct, frozen=True, kw_only=True, tag="snapshot", tag_field="type"
):
    """The whole scheduler state, for ``expeditor inspect``."""

    step: int
    num_running: int
    num_waiting: int
    num_swapped: int
    gpu_blocks: BlockUsage
    cpu_blocks: BlockUsage
    prefix_cache: PrefixCacheStats
    preemptions: dict[str, int]
    finished: dict[str, int]
    """Finished requests by reason (stop, length, abort) and rejected ones."""
    seqs: list[SeqInfo]


Message = BatchPlan | StepResult | WorkerHello | SchedulerSnapshot

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Decode one frame; raises ``msgspec.DecodeError`` / ``ValidationError`` if malformed."""
    return _decoder.decode(data)
