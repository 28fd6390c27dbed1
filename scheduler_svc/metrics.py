"""The scheduler daemon's request metrics: token counters and latency histograms, kept
as plain numbers (no Prometheus library in the scheduler) and sent to whoever asks with
``Metrics`` (the gateway renders them for Prometheus; docs/deploy.md lists them).

The :class:`~scheduler_svc.outputs.OutputProcessor` feeds :class:`RequestMetrics` as it
turns steps into replies, so every request counts, whichever client sent it.
"""

from __future__ import annotations

import bisect
from collections import Counter

from ipc.schema import HistogramData

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Seconds; vLLM's buckets with three finer ones below 10 ms (a CPU step is short)."""
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""Seconds, for end-to-end latency and queue time."""
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Histogram:
    """Observations counted per bucket (``le`` upper bounds, then ``+Inf``)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must increase strictly: {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls in that bucket (le = less or equal).
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def data(self) -> HistogramData:
        return HistogramData(
            bounds=[float(b) for b in self.bounds],
            counts=list(self.counts),
            sum=self.sum,
            count=self.count,
        )


class RequestMetrics:
    """Totals since the server started."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue = Histogram(REQUEST_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)

    def on_scheduled(self, num_prompt_tokens: int) -> None:
        """A request was scheduled for the first time."""
        self.prompt_tokens += num_prompt_tokens

    def on_step(self, num_scheduled_tokens: int, num_new_tokens: int) -> None:
        if num_scheduled_tokens:  # a plan with only frees or swaps computes nothing
            self.iteration_tokens.observe(num_scheduled_tokens)
        self.generation_tokens += num_new_tokens

    def on_finished(
        self, reason: str, queue_s: float, ttft_s: float | None, total_s: float
    ) -> None:
        """A request ended with a Finished reply (``ttft_s`` None: it produced no token)."""
        self.request_success[reason] += 1
        self.queue.observe(queue_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(total_s)

    def histograms(self) -> dict[str, HistogramData]:
        return {
            "time_to_first_token_seconds": self.ttft.data(),
            "inter_token_latency_seconds": self.itl.data(),
            "e2e_request_latency_seconds": self.e2e.data(),
            "request_queue_time_seconds": self.queue.data(),
            "iteration_tokens_total": self.iteration_tokens.data(),
        }
