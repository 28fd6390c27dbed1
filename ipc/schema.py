"""Every message that crosses a process boundary, as tagged frozen msgspec Structs.

Encoding is msgpack through :func:`encode` / :func:`decode`; nothing on the wire is
pickled. A decoder only accepts the message types listed in :data:`Message`, so a
malformed or unexpected frame fails with a ``msgspec.DecodeError`` / ``ValidationError``
instead of reaching application code.

Plans are deltas: a sequence the worker has no state for (new, resumed after swap or
recompute, or just forked from its n>1 parent) is sent in full as :class:`NewSeq`;
a sequence the worker already knows only sends its block-table changes
(:class:`BlockUpdate`) and its token count in ``num_scheduled_tokens``. Tokens the
worker itself sampled are never sent back to it. After a worker was lost the
scheduler requeues every sequence and resends each as :class:`NewSeq`; that plan has
``reset=True`` so a surviving worker forgets everything it held first. The worker side
of this protocol, strictly checked, is :mod:`ipc.plan_state`.

A worker executes one plan in this order: ``swap_out`` (device -> CPU pool),
``swap_in`` (CPU pool -> device), ``copies`` (copy-on-write, device -> device), then
one forward over every sequence in ``num_scheduled_tokens``, in that order. Within a
layer all new K/V are stored before any attention reads, so a sequence may read blocks
that another sequence of the same step writes (identical prompts admitted together).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from shared.outputs import Completion, FinishReason, PromptLogprobs
from shared.sampling import SamplingParams
from shared.worker_settings import WorkerSettings

__all__ = [
    "NO_TOKEN",
    "Abort",
    "AbortAck",
    "Accepted",
    "AttachSwapPool",
    "BatchPlan",
    "BlockUpdate",
    "BlockUsage",
    "ClientMessage",
    "ControlMessage",
    "Delta",
    "DeltaBatch",
    "ErrorCode",
    "ErrorReply",
    "Finished",
    "Generate",
    "Health",
    "HealthState",
    "HealthStatus",
    "Heartbeat",
    "HistogramData",
    "Inspect",
    "InspectReply",
    "Message",
    "Metrics",
    "MetricsReply",
    "NewSeq",
    "Ping",
    "Pong",
    "PrefixCacheStats",
    "SchedulerSnapshot",
    "SeqInfo",
    "SeqStatus",
    "ServerMessage",
    "Shutdown",
    "StepResult",
    "StepTimes",
    "StepTiming",
    "Timings",
    "Usage",
    "WorkerError",
    "WorkerHello",
    "WorkerInfo",
    "WorkerJoin",
    "WorkerMessage",
    "WorkerSetup",
    "WorkerStatus",
    "client_decoder",
    "control_decoder",
    "control_kind",
    "decode",
    "encode",
    "plan_decoder",
    "server_decoder",
    "worker_decoder",
]


# -- enumerated values: strings on the wire, an unknown one fails decoding ---------------


class SeqStatus(enum.StrEnum):
    """Where a sequence is in the scheduler (``SeqInfo.state``)."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class WorkerStatus(enum.StrEnum):
    STARTING = "starting"
    """Joined, loading the model."""
    READY = "ready"
    """Said hello: serving steps."""
    LOST = "lost"
    """Silent past its timeout, seen dead, or replaced."""


class HealthState(enum.StrEnum):
    OK = "ok"
    """Serving with every expected worker."""
    STARTING = "starting"
    """No worker ready yet."""
    DEGRADED = "degraded"
    """Serving, but a worker was lost."""
    DRAINING = "draining"
    """Stopping: requests in flight finish, new ones are refused."""


class ErrorCode(enum.StrEnum):
    """Why the server refused a request or frame, or could not finish a request."""

    BAD_REQUEST = "bad_request"
    """Malformed frame, wrong types, invalid parameters, a prompt too large or with
    token ids outside the vocabulary."""
    DUPLICATE = "duplicate"
    """The request id (or one of its sample ids) is in use."""
    UNKNOWN_REQUEST = "unknown_request"
    """No such request of this client."""
    REJECTED = "rejected"
    """The request can never fit (max_model_len or the whole KV capacity)."""
    OVERLOADED = "overloaded"
    """The waiting queue is full."""
    WORKER_LOST = "worker_lost"
    """No worker left to finish it."""
    QUARANTINED = "quarantined"
    """Steps holding this request made workers fail twice: it is not retried."""
    SHUTTING_DOWN = "shutting_down"
    """The server is stopping."""
    INTERNAL = "internal"
    """A server bug; the server keeps serving."""


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
    sampling: SamplingParams | None = None
    """The request's sampling parameters; ``None`` when the worker already holds them: a
    sequence of the same request is on the worker before this plan or carries them in
    it (the n-1 forks of an n>1 request carry this reference, not n-1 copies)."""


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
    reset: bool = False
    """Forget every sequence before applying this plan: the first plan after a worker
    was lost, which resends every sequence as NewSeq (a surviving worker's state is
    stale)."""
    swap_out: list[tuple[int, int]] = []
    """(device block, CPU pool block) copies, done first."""
    swap_in: list[tuple[int, int]] = []
    """(CPU pool block, device block) copies, done after swap_out."""
    copies: list[tuple[int, int]] = []
    """(source device block, destination device block) copy-on-write, done before the forward."""
    num_samples: dict[str, int] = {}
    """Sequences that must return more than one sampled token (the n>1 fork step)."""
    proposals: dict[str, list[int]] = {}
    """Speculative decoding: per speculating sequence, the tokens proposed after its
    last known one. They are computed after it in this step (``num_scheduled_tokens``
    counts them); the sequence's result is the longest run of them that equals the
    model's draws at their positions, then the draw after that run. The worker then
    holds the sequence's known tokens (the proposals dropped, the result appended),
    all but the last computed, and block table entries for those only: the scheduler
    releases the rest."""
    draft_lengths: dict[str, int] = {}
    """Speculative decoding with a draft model: per speculating sequence, how many
    tokens the workers' draft model proposes after its last known one (scheduled and
    verified as ``proposals`` are; a sequence is in one of the two at most)."""
    token_masks: dict[str, bytes] = {}
    """Structured output: per constrained sequence that samples, its allowed tokens
    (bit ``t % 32`` of little-endian int32 word ``t // 32``; every sample of a fork
    step draws under its sequence's mask)."""

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class StepTiming(msgspec.Struct, frozen=True, kw_only=True):
    swap_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    total_s: float = 0.0
    draft_s: float = 0.0
    """Of the step's preparation, the draft model's time (speculative decoding)."""
    forward_flop: float = 0.0
    """The forward's arithmetic, from the model's shapes (gpu_worker/step_flops.py)."""


class StepTimes(msgspec.Struct, frozen=True, kw_only=True):
    """Where a step's time goes: mean milliseconds per step over ``steps`` steps (the
    parts: :mod:`scheduler_svc.step_times`, docs/architecture.md "The step")."""

    schedule: float = 0.0
    transfer: float = 0.0
    prepare: float = 0.0
    swap: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    outputs: float = 0.0
    steps: int = 0
    forward_gflops: float = 0.0
    """Achieved GFLOP/s of the forwards: their FLOPs over their time."""


NO_TOKEN = -1
"""A sampled token id meaning that none could be drawn: every token was masked (the
request's constraints leave none), or the logits overflowed float32."""


class StepResult(msgspec.Struct, frozen=True, kw_only=True, tag="result", tag_field="type"):
    """What the worker sampled in one step.

    Only sequences whose scheduled tokens reached the end of their known tokens are
    sampled (a non-final prefill chunk produces nothing). A sequence gets one token, or
    one per sample on its fork step (``num_samples``), or, when it had proposals, its
    accepted ones and the token after them.
    """

    step: int
    sampled_token_ids: dict[str, list[int]]
    """Per sequence, its tokens; :data:`NO_TOKEN` where none could be drawn (the
    scheduler fails the request)."""
    logprobs: dict[str, list[dict[int, float]]] | None = None
    """Per sequence, per token it got: token id -> logprob (sampled + top-k)."""
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    """Per sequence whose request asked for them: the prompt positions this step's
    chunk computed the logprobs of (a recomputed prefill sends them again)."""
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
    eos_token_ids: list[int] = []
    """Every token id that ends generation (a model may list several)."""
    vocab_size: int = 0
    """Rows of the model's embedding: prompt token ids must be below it (0 = unknown)."""
    tensor_parallel_size: int = 1
    """The group this rank belongs to; ``kv_bytes_per_block`` is then the whole group's
    (each rank holds 1/N of it, and of every swap-pool block)."""
    draft_model: str = ""
    """The draft model's checkpoint when the workers draft speculative proposals
    (``speculative_model``; its K/V shares each block with the target's, so
    ``num_gpu_blocks`` counts both), else empty: proposals come from the scheduler."""
    kv_window: int = 0
    """Keys any layer reads at most back from a query's position: the sliding window
    when every attention layer has one (the largest), else 0 (some layer reads the whole
    context, or a draft model's K/V share the blocks). The scheduler releases blocks
    behind it; the workers' last block is then the null block released entries name."""
    kv_groups: list[int] = []
    """A cache laid out in layer groups (a model mixing windowed and full layers, whose
    windowed layers' blocks are given back): each group's window, 0 for full attention;
    a block holds one group's layers, a table every group's side by side
    (``scheduler_svc/core/kv_groups.py``). Empty: one group, every layer in a block."""
    kv_block_layers: list[int] = []
    """With ``kv_groups``: [the model's layers, the layers a block holds]. Block counts
    in the configuration (``num_gpu_blocks``, ``num_cpu_blocks``,
    ``prefix_cache_cpu_blocks``) are blocks of every layer; the worker's and the
    scheduler's pools hold as many bytes in these smaller blocks."""


class BlockUsage(msgspec.Struct, frozen=True, kw_only=True):
    total: int
    free: int
    """Blocks with refcount zero, prefix-cached or not."""
    cached: int = 0
    """Of the free blocks, those still holding a reusable prefix."""


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    queried_tokens: int
    hit_tokens: int
    """Found in either tier."""
    host_hit_tokens: int = 0
    """Of them, copied back from the host tier."""
    host_blocks: int = 0
    """Blocks of the host tier (``prefix_cache_cpu_blocks``; 0: no tier)."""
    host_cached_blocks: int = 0
    """Of them, those holding a prefix block now."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class SeqInfo(msgspec.Struct, frozen=True, kw_only=True):
    seq_id: str
    request_id: str
    state: SeqStatus
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


# -- scheduler <-> worker control -------------------------------------------------------


class WorkerJoin(msgspec.Struct, frozen=True, kw_only=True, tag="join", tag_field="type"):
    """A worker's first frame: who it is. The scheduler answers with WorkerSetup."""

    rank: int
    pid: int
    device: str
    host: str = ""
    """:func:`shared.procinfo.host_id` of the worker: when it equals the scheduler's, the
    scheduler watches ``pid`` and sees the worker die at once (not at its heartbeat
    timeout)."""
    start_time: int = 0
    """The worker process's start time (:func:`shared.procinfo.process_start_time`)."""


class WorkerSetup(msgspec.Struct, frozen=True, kw_only=True, tag="setup", tag_field="type"):
    """What the worker must load and how large its cache is; it answers WorkerHello."""

    settings: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    """Passed whole to the model runner; ``scheduler.num_gpu_blocks`` None sizes the
    cache from ``server.gpu_memory_utilization`` (CUDA)."""
    swap_pool: str | None = None
    """Name of the shared-memory swap pool, once it exists."""


class AttachSwapPool(
    msgspec.Struct, frozen=True, kw_only=True, tag="attach_pool", tag_field="type"
):
    """Map the swap pool the scheduler created after the first WorkerHello."""

    name: str


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat", tag_field="type"):
    rank: int


class WorkerError(msgspec.Struct, frozen=True, kw_only=True, tag="worker_error", tag_field="type"):
    """A worker that cannot serve says why before it exits non-zero."""

    rank: int
    message: str


class Shutdown(msgspec.Struct, frozen=True, kw_only=True, tag="shutdown", tag_field="type"):
    """Leave cleanly (exit 0); with ``restart``, exit 3 so that the supervisor (or
    systemd's Restart=on-failure) starts the worker again: a tensor-parallel group that
    lost a rank restarts as a whole."""

    restart: bool = False


# -- client <-> scheduler ------------------------------------------------------------------


class Generate(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag="generate",
    tag_field="type",
    forbid_unknown_fields=True,
):
    """Submit a request: exactly one of ``prompt`` (text) and ``prompt_token_ids``."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    stream: bool = False
    """Send a Delta event per step; without it only Accepted and Finished come."""
    user: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """The end user on whose behalf a shared client (the HTTP gateway) sends this: fair
    share and the per-user queue cap count requests per (connection, user). An opaque
    label (the gateway sends a hash of the API key or the client's address, never a
    raw key); "" = the connection itself."""


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort", tag_field="type"):
    request_id: str


class Inspect(msgspec.Struct, frozen=True, kw_only=True, tag="inspect", tag_field="type"):
    pass


class Health(msgspec.Struct, frozen=True, kw_only=True, tag="health", tag_field="type"):
    pass


class Metrics(msgspec.Struct, frozen=True, kw_only=True, tag="metrics", tag_field="type"):
    """Ask for the server's counters, gauges and latency histograms (:class:`MetricsReply`)."""


class Ping(msgspec.Struct, frozen=True, kw_only=True, tag="ping", tag_field="type"):
    """Client keep-alive: a client silent for ``client_timeout_s`` while it has requests
    in flight is taken as gone, and its requests are aborted."""

    sequenced: bool = False
    """Ask the server to number its replies to this connection from now on: each then
    comes as two frames, the message and its number (8 bytes, big-endian, from 0, one
    more per reply), so the client sees a reply that was lost (a gap) or that the
    server started afresh (0 again). Asked again after the server forgot the client."""


class Accepted(msgspec.Struct, frozen=True, kw_only=True, tag="accepted", tag_field="type"):
    request_id: str
    prompt_token_ids: list[int]


class Delta(msgspec.Struct, frozen=True, kw_only=True, tag="delta", tag_field="type"):
    """New tokens of one sample since the last Delta (streaming requests only)."""

    request_id: str
    index: int
    """Sample index (0..n-1)."""
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    """With finish_reason ``stop``: the stop string or stop token id (None for EOS)."""
    prompt_logprobs: PromptLogprobs | None = None
    """On a request's first Delta, when it asked for them: every prompt position's."""


class DeltaBatch(msgspec.Struct, frozen=True, kw_only=True, tag="deltas", tag_field="type"):
    """The Deltas of one step for one client, in one frame (a client with many
    streaming requests gets one message per step, not one per token)."""

    deltas: list[Delta]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache when the request was first
    scheduled."""


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    queue_s: float
    """Arrival to first scheduled."""
    ttft_s: float
    """Arrival to first output token."""
    total_s: float
    """Arrival to finish."""


class Finished(msgspec.Struct, frozen=True, kw_only=True, tag="finished", tag_field="type"):
    request_id: str
    completion: Completion
    usage: Usage
    timings: Timings


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="type"):
    """A request or frame the server refused, or a request it could not finish; see
    :class:`ErrorCode`."""

    request_id: str | None
    code: ErrorCode
    message: str
    field: str | None = None
    """The request field the refusal names (``logit_bias``, ``prompt_token_ids``...), as
    ``Generate`` and ``SamplingParams`` call it; None when it names none."""


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    pid: int
    device: str
    state: WorkerStatus
    num_gpu_blocks: int | None = None
    group_size: int = 1
    """Ranks of its tensor-parallel group (1: a whole replica); known once ready."""


class HealthStatus(
    msgspec.Struct, frozen=True, kw_only=True, tag="health_status", tag_field="type"
):
    status: HealthState
    workers_ready: int
    workers_expected: int
    step: int
    uptime_s: float


class InspectReply(
    msgspec.Struct, frozen=True, kw_only=True, tag="inspect_reply", tag_field="type"
):
    snapshot: SchedulerSnapshot | None
    """None until the first worker registered (the budget is sized from it)."""
    workers: list[WorkerInfo]
    config: dict[str, object]
    model: str
    frontend: str
    step_times: StepTimes | None = None
    """Moving mean over the last steps (``steps`` of them); None before the first step."""
    step_times_total: StepTimes | None = None
    """Mean over every step since the server started."""


class HistogramData(msgspec.Struct, frozen=True, kw_only=True):
    """A cumulative histogram as Prometheus keeps one."""

    bounds: list[float]
    """Upper bounds of the buckets, increasing; a last ``+Inf`` bucket is implied."""
    counts: list[int]
    """Observations per bucket (not cumulative), ``len(bounds) + 1`` of them."""
    sum: float
    count: int


class MetricsReply(
    msgspec.Struct, frozen=True, kw_only=True, tag="metrics_reply", tag_field="type"
):
    """The server's state and the totals since it started, for Prometheus (the gateway's
    ``/metrics``). Counts every request, whichever client sent it. Names follow vLLM's
    metrics (docs/deploy.md)."""

    model: str
    num_requests_running: int
    num_requests_waiting: int
    num_requests_swapped: int
    kv_cache_usage_perc: float
    """Share of device KV blocks in use (0..1)."""
    cpu_swap_usage_perc: float
    """Share of CPU swap-pool blocks in use (0..1)."""
    num_preemptions: dict[str, int]
    """By mode: swap, recompute."""
    prompt_tokens: int
    """Prompt tokens of the requests scheduled so far (prefix-cache hits included)."""
    generation_tokens: int
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Of them, found in either tier (the device's, or the host tier's)."""
    request_success: dict[str, int]
    """Finished requests by finish reason of their first sample: stop, length, abort."""
    histograms: dict[str, HistogramData]
    """time_to_first_token_seconds, inter_token_latency_seconds,
    e2e_request_latency_seconds, request_queue_time_seconds, iteration_tokens_total."""
    spec_decode_num_drafts: int = 0
    """Speculative decoding: proposals verified (one per sequence and step)."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    """Entry i: how often the i-th token of a proposal was accepted."""
    prefix_cache_host_hits: int = 0
    """Prompt tokens copied back from the prefix cache's host tier instead of computed."""
    prefix_cache_host_demoted_blocks: int = 0
    """Device blocks evicted from the prefix cache that the host tier kept."""
    cache_config: dict[str, str] = {}
    """The KV cache's settings (block_size, num_gpu_blocks, ...), as vLLM's
    ``cache_config_info`` labels; empty before a worker said hello."""


class AbortAck(msgspec.Struct, frozen=True, kw_only=True, tag="abort_ack", tag_field="type"):
    """Answer to Abort. ``aborted`` is False when the request had already finished; an
    unknown id gets ErrorReply(code=UNKNOWN_REQUEST) instead. The aborted request's
    own waiter then gets Finished with finish_reason "abort"."""

    request_id: str
    aborted: bool


class Pong(msgspec.Struct, frozen=True, kw_only=True, tag="pong", tag_field="type"):
    instance: str = ""
    """Which run of the server answered (random, drawn at its start): a client that
    sees it change while requests wait knows they died with the server before it."""


ClientMessage = Generate | Abort | Inspect | Health | Ping | Metrics
ServerMessage = (
    Accepted
    | Delta
    | DeltaBatch
    | Finished
    | ErrorReply
    | AbortAck
    | HealthStatus
    | InspectReply
    | MetricsReply
    | Pong
)
WorkerMessage = WorkerJoin | WorkerHello | StepResult | Heartbeat | WorkerError
ControlMessage = WorkerSetup | AttachSwapPool | BatchPlan | Shutdown
Message = ClientMessage | ServerMessage | WorkerMessage | ControlMessage | SchedulerSnapshot

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
"""What the scheduler's frontend accepts."""
server_decoder = msgspec.msgpack.Decoder(ServerMessage)
"""What clients accept."""
worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
"""What the scheduler accepts from workers."""
control_decoder = msgspec.msgpack.Decoder(ControlMessage)
"""What workers accept from the scheduler."""
plan_decoder = msgspec.msgpack.Decoder(BatchPlan)
"""A frame :func:`control_kind` says is a plan (decoded where the step runs)."""


class _Tagged(msgspec.Struct):
    type: str


_tag_decoder = msgspec.msgpack.Decoder(_Tagged)


def control_kind(data: bytes) -> str:
    """The tag of a control frame (``"plan"``, ``"shutdown"``, ...) without decoding the
    rest: the other fields are skipped, not built or validated, so a worker's I/O thread
    learns what a plan is at the cost of a scan. Raises like :func:`decode`."""
    return _tag_decoder.decode(data).type


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Decode one frame; raises ``msgspec.DecodeError`` / ``ValidationError`` if malformed."""
    return _decoder.decode(data)
