"""Per-request timelines and the metrics ``expeditor bench`` reports for each target.

Definitions (all times in seconds on one clock; results are reported in milliseconds):

- **TTFT** (time to first token) = first token time - arrival;
- **E2E** (end-to-end latency) = finish - arrival;
- **TPOT** (time per output token) = (E2E - TTFT) / (output tokens - 1), per request,
  undefined for requests with at most one output token;
- **ITL** (inter-token latency) = the gaps between consecutive token times of a request,
  pooled over all requests (a request with one token contributes none);
- **duration** = from the first arrival to the last finish (unless the caller passes its
  own); request throughput = requests / duration, output throughput = output tokens /
  duration.

Summaries are ``{"mean", "p50", "p99"}`` (:func:`shared.stats.summarize`: percentiles
linearly interpolated between order statistics); an empty list summarises to ``None``
(e.g. TPOT when every request produced a single token).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import msgspec

from expeditor.bench.workloads import Workload
from ipc.schema import StepTimes
from shared.stats import summarize

__all__ = [
    "KVSample",
    "RequestTimeline",
    "TargetResult",
    "compute_result",
    "e2e",
    "itls",
    "kv_stats",
    "tpot",
    "ttft",
]


@dataclass(slots=True)
class RequestTimeline:
    """What a client saw of one request.

    ``token_times_s`` holds the absolute time each output token became available to the
    client, on the same clock as ``arrival_s`` and ``finish_s``. Several tokens delivered in
    one message share a time. A target that learns its tokens only at the end gives one
    time per token, all equal to ``finish_s`` (see :meth:`at_finish`): its TTFT then equals
    its E2E latency and its TPOT and ITLs are 0. ``num_output_tokens`` is usually
    ``len(token_times_s)``.
    """

    request_id: str
    arrival_s: float
    token_times_s: list[float]
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int

    @classmethod
    def at_finish(
        cls,
        request_id: str,
        arrival_s: float,
        finish_s: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> RequestTimeline:
        """A timeline for a target that only learns the tokens when the request finishes."""
        return cls(
            request_id,
            arrival_s,
            [finish_s] * num_output_tokens,
            finish_s,
            num_prompt_tokens,
            num_output_tokens,
        )


def ttft(t: RequestTimeline) -> float | None:
    """Seconds from arrival to the first token; ``None`` when no token arrived."""
    return t.token_times_s[0] - t.arrival_s if t.token_times_s else None


def e2e(t: RequestTimeline) -> float:
    """Seconds from arrival to finish."""
    return t.finish_s - t.arrival_s


def tpot(t: RequestTimeline) -> float | None:
    """``(E2E - TTFT) / (num_output_tokens - 1)`` in seconds; ``None`` when the request has
    at most one output token (or no token times)."""
    first = ttft(t)
    if first is None or t.num_output_tokens <= 1:
        return None
    return (e2e(t) - first) / (t.num_output_tokens - 1)


def itls(t: RequestTimeline) -> list[float]:
    """Gaps in seconds between consecutive token times (empty for fewer than two tokens)."""
    return [later - earlier for earlier, later in pairwise(t.token_times_s)]


def _scaled(summary: dict[str, float] | None, factor: float) -> dict[str, float] | None:
    return None if summary is None else {key: value * factor for key, value in summary.items()}


@dataclass(frozen=True, slots=True)
class KVSample:
    """The KV cache at one moment.

    ``used_blocks`` of ``total_blocks`` GPU blocks are in use; the running requests hold
    ``allocated_slots`` token slots (their blocks x block size) of which ``filled_slots``
    hold computed tokens.
    """

    time_s: float
    used_blocks: int
    total_blocks: int
    allocated_slots: int
    filled_slots: int


def kv_stats(samples: Iterable[KVSample]) -> dict[str, float] | None:
    """``{"mean_usage", "peak_usage", "mean_waste"}`` as fractions in [0, 1].

    usage = ``used_blocks / total_blocks`` (mean and maximum over samples with
    ``total_blocks > 0``); waste = ``(allocated_slots - filled_slots) / allocated_slots``,
    the share of allocated slots not holding a token (internal fragmentation), averaged over
    samples with ``allocated_slots > 0`` (0.0 when there are none). ``None`` when no sample
    has ``total_blocks > 0``.
    """
    data = list(samples)
    usage = [s.used_blocks / s.total_blocks for s in data if s.total_blocks > 0]
    if not usage:
        return None
    waste = [
        (s.allocated_slots - s.filled_slots) / s.allocated_slots
        for s in data
        if s.allocated_slots > 0
    ]
    return {
        "mean_usage": math.fsum(usage) / len(usage),
        "peak_usage": max(usage),
        "mean_waste": math.fsum(waste) / len(waste) if waste else 0.0,
    }


class TargetResult(msgspec.Struct, kw_only=True):
    """What ``expeditor bench`` reports for one target on one workload.

    Latency summaries (``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``) are
    ``{"mean", "p50", "p99"}`` in milliseconds, or ``None`` when no request gave a value.
    ``kv`` is :func:`kv_stats` of the target's samples (``None``: not reported);
    ``preemptions`` maps a mode (e.g. ``"swap"``, ``"recompute"``) to a count;
    ``prefix_cache_hit_rate`` is the share of queried prompt tokens found in the cache;
    ``step_ms`` is where a step's time went, mean milliseconds per step over the run
    (:class:`~ipc.schema.StepTimes`; ``None`` for targets without a step engine).
    """

    target: str
    workload: str
    num_requests: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_output_tokens: int
    ttft_ms: dict[str, float] | None
    tpot_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    e2e_ms: dict[str, float] | None
    kv: dict[str, float] | None = None
    preemptions: dict[str, int] | None = None
    prefix_cache_hit_rate: float | None = None
    notes: list[str] = []
    total_prompt_tokens: int = 0
    step_ms: StepTimes | None = None
    peak_concurrency: int = 0
    """Most requests generating at once: between a request's first token and its finish,
    as the client saw them (:func:`peak_concurrency`)."""


def peak_concurrency(timelines: Iterable[RequestTimeline]) -> int:
    """The most requests whose first token had come and whose finish had not, at any
    moment (a request finishing when another's first token comes does not overlap it)."""
    events = sorted(
        (time, change)
        for t in timelines
        if t.token_times_s
        for time, change in ((t.token_times_s[0], 1), (t.finish_s, -1))
    )  # at equal times the finish (-1) sorts first
    peak = current = 0
    for _, change in events:
        current += change
        peak = max(peak, current)
    return peak


def compute_result(
    target: str,
    workload: str | Workload,
    timelines: Sequence[RequestTimeline],
    duration_s: float | None = None,
    *,
    kv_samples: Iterable[KVSample] | None = None,
    preemptions: dict[str, int] | None = None,
    prefix_hit_rate: float | None = None,
    step_times: StepTimes | None = None,
) -> TargetResult:
    """Summarise the ``timelines`` of one target's run into a :class:`TargetResult`.

    ``workload`` is the workload's name (or a ``Workload``, whose ``name`` is used).
    ``duration_s`` is the wall time the throughputs divide by; ``None`` derives it as the
    last ``finish_s`` minus the first ``arrival_s`` of the timelines. A non-positive duration
    gives throughputs of 0 and a note. Requests with no token times are left out of TTFT
    and TPOT (but count in E2E and the throughputs), with a note.
    """
    name = workload if isinstance(workload, str) else workload.name
    notes: list[str] = []
    if duration_s is None:
        duration_s = (
            max(t.finish_s for t in timelines) - min(t.arrival_s for t in timelines)
            if timelines
            else 0.0
        )
    total_out = sum(t.num_output_tokens for t in timelines)
    total_prompt = sum(t.num_prompt_tokens for t in timelines)
    if duration_s > 0:
        request_throughput = len(timelines) / duration_s
        output_throughput = total_out / duration_s
    else:
        request_throughput = output_throughput = 0.0
        if timelines:
            notes.append(f"duration {duration_s:g} s is not positive: throughputs reported as 0")

    ttfts = [value for t in timelines if (value := ttft(t)) is not None]
    tpots = [value for t in timelines if (value := tpot(t)) is not None]
    gaps = [gap for t in timelines for gap in itls(t)]
    silent = len(timelines) - len(ttfts)
    if silent:
        notes.append(
            f"{silent} of {len(timelines)} requests reported no output tokens "
            "(left out of TTFT and TPOT)"
        )
    if ttfts and not tpots:
        notes.append("no request produced more than one output token: TPOT and ITL undefined")
    multi = [t for t in timelines if len(t.token_times_s) > 1]
    if multi and all(
        all(time == t.finish_s for time in t.token_times_s) for t in timelines if t.token_times_s
    ):
        notes.append("token times known only at finish: TTFT equals E2E, TPOT and ITL are 0")

    samples = list(kv_samples) if kv_samples is not None else []
    return TargetResult(
        target=target,
        workload=name,
        num_requests=len(timelines),
        duration_s=duration_s,
        request_throughput=request_throughput,
        output_throughput=output_throughput,
        total_output_tokens=total_out,
        ttft_ms=_scaled(summarize(ttfts), 1e3),
        tpot_ms=_scaled(summarize(tpots), 1e3),
        itl_ms=_scaled(summarize(gaps), 1e3),
        e2e_ms=_scaled(summarize(e2e(t) for t in timelines), 1e3),
        kv=kv_stats(samples),
        preemptions=dict(preemptions) if preemptions is not None else None,
        prefix_cache_hit_rate=prefix_hit_rate,
        notes=notes,
        total_prompt_tokens=total_prompt,
        step_ms=step_times,
        peak_concurrency=peak_concurrency(timelines),
    )
