"""``GET /metrics``: the scheduler's :class:`~ipc.schema.MetricsReply` in the Prometheus
text format, under vLLM's metric names with the prefix ``expeditor:`` (a vLLM Grafana
dashboard ports by renaming ``vllm:`` to ``expeditor:``), label ``model_name``.

Every scrape asks the scheduler afresh; nothing is cached in the gateway, so a
restarted gateway loses nothing and requests sent through the ZeroMQ client count too.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ipc.schema import MetricsReply

__all__ = ["PREFIX", "render_metrics"]

PREFIX = "expeditor:"

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
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
)
_HISTOGRAMS = {
    "time_to_first_token_seconds": "Arrival to first token, seconds.",
    "inter_token_latency_seconds": "Time between a request's consecutive tokens, seconds.",
    "e2e_request_latency_seconds": "Arrival to finish, seconds.",
    "request_queue_time_seconds": "Arrival to first scheduled, seconds.",
    "iteration_tokens_total": "Tokens computed per step.",
}


class _ReplyCollector(Collector):
    def __init__(self, reply: MetricsReply, model_name: str) -> None:
        self.reply = reply
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        reply, model = self.reply, [self.model_name]
        for name, doc in _GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric(model, float(getattr(reply, name)))
            yield gauge
        for name, doc in _COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(model, float(getattr(reply, name)))
            yield counter
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions",
            "Sequences preempted, by mode (swap or recompute).",
            labels=["model_name", "mode"],
        )
        for mode, count in sorted(reply.num_preemptions.items()):
            preemptions.add_metric([*model, mode], float(count))
        yield preemptions
        success = CounterMetricFamily(
            PREFIX + "request_success",
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
            family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
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


def render_metrics(reply: MetricsReply, model_name: str) -> bytes:
    """The Prometheus text exposition of ``reply``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReplyCollector(reply, model_name))
    return generate_latest(registry)
