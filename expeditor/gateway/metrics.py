"""``GET /metrics``: the scheduler's :class:`~ipc.schema.MetricsReply` in the Prometheus
text format, under vLLM's metric names with the prefix ``expeditor:``, ``vllm:`` or both
(``[gateway] metrics_prefix``: routers, dashboards and autoscaling rules written for
vLLM read ``vllm:num_requests_waiting`` and the like), label ``model_name``.

The numbers are the scheduler's, so a restarted gateway loses nothing and requests
sent through the ZeroMQ client count too. Scrapes share snapshots
(:class:`MetricsCache`): a storm of them costs the scheduler one query per
``metrics_interval_s`` (plus one per request this gateway finished), not one each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ipc.schema import MetricsReply

__all__ = ["PREFIX", "PREFIXES", "MetricsCache", "render_metrics"]

PREFIX = "expeditor:"
PREFIXES: dict[str, tuple[str, ...]] = {
    "expeditor": (PREFIX,),
    "vllm": ("vllm:",),
    "both": (PREFIX, "vllm:"),
}
"""``[gateway] metrics_prefix`` -> the prefixes every metric is rendered under."""

_GAUGES = (
    ("num_requests_running", "Sequences in the running queue (on the workers)."),
    ("num_requests_waiting", "Sequences waiting to be admitted."),
    ("num_requests_swapped", "Sequences preempted to the CPU swap pool."),
    ("kv_cache_usage_perc", "Share of device KV-cache blocks in use (1 = full)."),
    ("cpu_swap_usage_perc", "Share of CPU swap-pool blocks in use (1 = full)."),
)
_COUNTERS = (
    ("prompt_tokens", "Prompt tokens of the requests scheduled."),
    ("generation_tokens", "Tokens generated."),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache (either tier)."),
    ("prefix_cache_host_hits", "Prompt tokens copied back from the prefix cache's host tier."),
    (
        "prefix_cache_host_demoted_blocks",
        "Device blocks evicted from the prefix cache that the host tier kept.",
    ),
    ("spec_decode_num_drafts", "Speculative decoding: proposals verified."),
    ("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed."),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."),
)
_HISTOGRAMS = {
    "time_to_first_token_seconds": "Arrival to first token, seconds.",
    "inter_token_latency_seconds": "Time between a request's consecutive tokens, seconds.",
    "e2e_request_latency_seconds": "Arrival to finish, seconds.",
    "request_queue_time_seconds": "Arrival to first scheduled, seconds.",
    "iteration_tokens_total": "Tokens computed per step.",
}


class _ReplyCollector(Collector):
    def __init__(self, reply: MetricsReply, model_name: str, prefix: str) -> None:
        self.reply = reply
        self.model_name = model_name
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        reply, model, prefix = self.reply, [self.model_name], self.prefix
        if reply.cache_config:
            labels = sorted(reply.cache_config)
            info = GaugeMetricFamily(
                prefix + "cache_config_info",
                "The KV cache's settings, as labels (value 1).",
                labels=["model_name", *labels],
            )
            info.add_metric([*model, *(reply.cache_config[k] for k in labels)], 1.0)
            yield info
        for name, doc in _GAUGES:
            gauge = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
            gauge.add_metric(model, float(getattr(reply, name)))
            yield gauge
        for name, doc in _COUNTERS:
            counter = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
            counter.add_metric(model, float(getattr(reply, name)))
            yield counter
        preemptions = CounterMetricFamily(
            prefix + "num_preemptions", "Sequences preempted.", labels=["model_name"]
        )
        preemptions.add_metric(model, float(sum(reply.num_preemptions.values())))
        yield preemptions
        by_mode = CounterMetricFamily(
            prefix + "num_preemptions_by_mode",
            "Sequences preempted, by mode (swap or recompute).",
            labels=["model_name", "mode"],
        )
        for mode in sorted({"swap", "recompute", *reply.num_preemptions}):
            by_mode.add_metric([*model, mode], float(reply.num_preemptions.get(mode, 0)))
        yield by_mode
        per_position = CounterMetricFamily(
            prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: proposed tokens accepted, by position in the proposal.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(reply.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([*model, str(position)], float(count))
        yield per_position
        success = CounterMetricFamily(
            prefix + "request_success",
            "Requests finished, by the finish reason of their first sample.",
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted({"stop", "length", "abort", *reply.request_success}):
            success.add_metric([*model, reason], float(reply.request_success.get(reason, 0)))
        yield success
        for name, doc in _HISTOGRAMS.items():
            data = reply.histograms.get(name)
            if data is None:
                continue
            family = HistogramMetricFamily(prefix + name, doc, labels=["model_name"])
            cumulative, buckets = 0, []
            for bound, count in zip([*data.bounds, float("inf")], data.counts, strict=True):
                cumulative += count
                buckets.append((_bound(bound), float(cumulative)))
            family.add_metric(model, buckets, data.sum)
            yield family


def _bound(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


def render_metrics(
    reply: MetricsReply, model_name: str, prefixes: tuple[str, ...] = (PREFIX,)
) -> bytes:
    """The Prometheus text exposition of ``reply``, every metric under each prefix."""
    registry = CollectorRegistry(auto_describe=False)
    for prefix in prefixes:
        registry.register(_ReplyCollector(reply, model_name, prefix))
    return generate_latest(registry)


class MetricsCache:
    """The rendered /metrics text from a snapshot of the scheduler's numbers, taken at
    most once per ``interval_s``: scrapes while one is being taken wait for it (one
    scheduler query however many scrape at once), later ones reuse it until it is
    ``interval_s`` old. :meth:`invalidate` (a request through this gateway finished)
    makes the next scrape take a new one, so a client sees its own finished requests
    counted. A failed query is not kept: every scrape waiting on it gets the error."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[MetricsReply]],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        prefixes: tuple[str, ...] = (PREFIX,),
    ) -> None:
        self._fetch = fetch
        self.interval_s = interval_s
        self.prefixes = prefixes
        self._clock = clock
        self._version = 0
        """Bumped by :meth:`invalidate`; a snapshot is current for the version at which
        its query started."""
        self._reply: MetricsReply | None = None
        self._reply_version = -1
        self._taken = 0.0
        self._rendered: tuple[MetricsReply, str, bytes] | None = None
        self._pending: asyncio.Future[MetricsReply] | None = None
        self._pending_version = -1
        self.queries = 0
        """Scheduler queries made (for tests and debugging)."""

    def invalidate(self) -> None:
        self._version += 1

    def _current(self) -> bool:
        return (
            self._reply is not None
            and self._reply_version == self._version
            and self._clock() - self._taken < self.interval_s
        )

    async def reply(self) -> MetricsReply:
        """A snapshot taken no earlier than the last :meth:`invalidate` before this call."""
        wanted = self._version
        while True:
            if self._current():
                assert self._reply is not None
                return self._reply
            if self._pending is None:
                self._pending_version = self._version
                self._pending = asyncio.ensure_future(self._query())
                # retrieved here too, in case every scrape waiting on it was cancelled
                self._pending.add_done_callback(lambda f: f.cancelled() or f.exception())
            version = self._pending_version
            reply = await asyncio.shield(self._pending)
            if version >= wanted:
                return reply
            # that query began before an invalidation this scrape must see: take another

    async def _query(self) -> MetricsReply:
        version, started = self._version, self._clock()
        self.queries += 1
        try:
            reply = await self._fetch()
        finally:
            self._pending = None
        if version >= self._reply_version:
            self._reply, self._reply_version, self._taken = reply, version, started
        return reply

    async def text(self, model_name: Callable[[MetricsReply], str]) -> bytes:
        """The Prometheus text of a snapshot (rendered once per snapshot and name)."""
        reply = await self.reply()
        name = model_name(reply)
        rendered = self._rendered
        if rendered is None or rendered[0] is not reply or rendered[1] != name:
            rendered = (reply, name, render_metrics(reply, name, self.prefixes))
            self._rendered = rendered
        return rendered[2]
