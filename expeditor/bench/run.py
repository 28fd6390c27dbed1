"""Running a workload against targets and reporting the results side by side."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from expeditor.bench.metrics import TargetResult, compute_result
from expeditor.bench.openai_target import parse_openai_target
from expeditor.bench.targets import OPENAI, RUNNERS, TARGETS, TargetRun
from expeditor.bench.workloads import Workload
from shared.config import SCHEDULER_FIELDS, SchedulerConfig
from shared.errors import ConfigError

SERVE_OPTIONS = (
    "tensor_parallel_size",
    "cpu_threads",
    "model_impl",
    "cuda_graphs",
    "speculative_model",
    "kv_cache_dtype",
)
"""[server] settings the expeditor target takes in its brackets (passed to serve)."""
SERVE_KEY = "serve"
"""Where those travel in a target's config (the expeditor runner takes them out)."""

BENCH_DEFAULTS: dict[str, Any] = {"num_gpu_blocks": 2048}
"""Scheduler settings a bench uses unless the workload or the command line says otherwise."""


@dataclass(frozen=True)
class TargetSpec:
    """``NAME`` or ``NAME[key=value,...]``: a target with scheduler-config overrides; or
    ``openai:URL[key=value,...]``: a running server, whose ``options`` hold the URL and the
    options of :func:`~expeditor.bench.openai_target.parse_openai_target`."""

    name: str
    overrides: dict[str, Any]
    label: str
    options: dict[str, Any] = field(default_factory=dict)


CONSTRAINTS = "constraints"
"""``NAME[constraints=off]``: the workload's requests without their structured outputs,
each as long as under the constrained target before it (:func:`unconstrained`)."""


def _switch(target: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("on", "off", "true", "false"):
        raise ValueError(f"target {target!r}: constraints= takes on or off, got {value!r}")
    return lowered in ("on", "true")


def unconstrained(
    workload: Workload, lengths: dict[str, int] | None, source: str | None
) -> tuple[Workload, str]:
    """``workload`` without constraints: each request generating exactly as many tokens
    as it did under ``source`` (``lengths``: its output tokens there), EOS ignored; a
    note saying so."""
    requests = []
    for req in workload.requests:
        replace: dict[str, Any] = {"structured_outputs": None}
        if lengths is not None and lengths.get(req.request_id):
            replace.update(max_tokens=lengths[req.request_id], ignore_eos=True)
        requests.append(msgspec.structs.replace(req, **replace))
    if lengths is None:
        note = "constraints off; no constrained target ran before it: outputs end at EOS"
    else:
        note = f"constraints off: each request generates as many tokens as under {source}"
    return msgspec.structs.replace(workload, requests=requests), note


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_target(text: str) -> TargetSpec:
    if text.startswith(OPENAI + ":"):
        options, label = parse_openai_target(text)
        return TargetSpec(OPENAI, {}, label, options)
    name, _, rest = text.partition("[")
    if name == OPENAI:
        raise ValueError(f"target {text!r}: give the server's address, openai:URL")
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; targets: {', '.join(TARGETS)}, {OPENAI}:URL")
    overrides: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if rest:
        if not rest.endswith("]"):
            raise ValueError(f"target {text!r}: expected NAME[key=value,...]")
        for item in filter(None, rest[:-1].split(",")):
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if sep and key == "dtype":  # any target but openai: its dtype (--dtype's)
                options["dtype"] = value.strip()
                continue
            if sep and key == CONSTRAINTS:
                options[CONSTRAINTS] = _switch(text, value)
                continue
            if sep and name == "expeditor" and key in SERVE_OPTIONS:
                options.setdefault(SERVE_KEY, {})[key] = _value(value.strip())
                continue
            if not sep or key not in SCHEDULER_FIELDS:
                extra = f" (or {', '.join(SERVE_OPTIONS)})" if name == "expeditor" else ""
                raise ValueError(
                    f"target {text!r}: {item!r} is not key=value with a scheduler config key"
                    + extra
                )
            overrides[key] = _value(value.strip())
    return TargetSpec(name, overrides, text, options)


def target_config(workload: Workload, base: dict[str, Any], spec: TargetSpec) -> dict[str, Any]:
    """Config for one target: bench defaults < workload hints < command line < target.

    An ``openai`` target gets its options instead: the server keeps its own settings.
    """
    if spec.name == OPENAI:
        return dict(spec.options)
    config = {**BENCH_DEFAULTS, **workload.config, **base, **spec.overrides}
    try:
        SchedulerConfig(**config)
    except (ConfigError, TypeError) as exc:
        raise ValueError(f"target {spec.label}: {exc}") from None
    if SERVE_KEY in spec.options:
        config[SERVE_KEY] = dict(spec.options[SERVE_KEY])
    return config


def run_bench(
    workload: Workload,
    specs: list[TargetSpec],
    *,
    model: Path,
    base_config: dict[str, Any],
    device: str,
    on_done: Callable[[str], None],
    on_start: Callable[[str], None] = lambda label: None,
    dtype: str = "auto",
) -> list[tuple[TargetResult, TargetRun]]:
    """``dtype``: every target but ``openai`` (a server keeps its own) computes in it,
    unless its brackets say otherwise (``expeditor[dtype=float32]``)."""
    results = []
    constrained = workload.constrained
    lengths: dict[str, int] | None = None
    source: str | None = None
    """The first constrained target's output lengths (constraints=off replays them)."""
    for spec in specs:
        config = target_config(workload, base_config, spec)
        if spec.name != OPENAI:  # serve's --dtype, LLM's dtype, transformers' dtype
            config["dtype"] = spec.options.get("dtype", dtype)
        load, extra_notes = workload, []
        if constrained and spec.options.get(CONSTRAINTS) is False:
            load, note = unconstrained(workload, lengths, source)
            extra_notes.append(note)
        on_start(spec.label)
        done = functools.partial(on_done, spec.label)
        run = RUNNERS[spec.name](load, model, config, device, done)
        if constrained and load is workload and lengths is None:
            lengths = {t.request_id: t.num_output_tokens for t in run.timelines}
            source = spec.label
        result = compute_result(
            spec.label,
            workload.name,
            run.timelines,
            kv_samples=run.kv_samples,
            preemptions=run.preemptions,
            prefix_hit_rate=run.prefix_hit_rate,
            step_times=run.step_times,
        )
        notes = [*run.notes, *extra_notes, *_unapplied(workload, base_config, spec)]
        if notes:
            result = msgspec.structs.replace(result, notes=[*result.notes, *notes])
        results.append((result, run))
    return results


def _unapplied(workload: Workload, base: dict[str, Any], spec: TargetSpec) -> list[str]:
    """Scheduler settings an ``openai`` target cannot apply to a server already running."""
    if spec.name != OPENAI:
        return []
    settings = {**workload.config, **base}
    if not settings:
        return []
    listed = ", ".join(f"{key}={value}" for key, value in settings.items())
    return [f"scheduler settings not applied (the server keeps its own): {listed}"]


def report_json(workload: Workload, results: list[TargetResult], *, seed: int, model: Path) -> str:
    return json.dumps(
        {
            "workload": workload.name,
            "description": workload.description,
            "num_requests": len(workload.requests),
            "seed": seed,
            "model": str(model),
            "results": msgspec.to_builtins(results),
        }
    )


def write_plots(results: list[tuple[TargetResult, TargetRun]], out_dir: Path) -> list[Path]:
    """throughput.png (output tokens/s per target), latency_cdf.png (E2E and TTFT per
    request), kv_usage.png (KV blocks in use over time, where the target reports it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    labels = [r.target for r, _ in results]
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(labels)), 3.5))
    ax.bar(labels, [r.output_throughput for r, _ in results], color="tab:blue")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{results[0][0].workload}: throughput" if results else "throughput")
    fig.tight_layout()
    written.append(out_dir / "throughput.png")
    fig.savefig(written[-1])
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for result, run in results:
        per_request = {
            "e2e": [t.finish_s - t.arrival_s for t in run.timelines],
            "ttft": [t.token_times_s[0] - t.arrival_s for t in run.timelines if t.token_times_s],
        }
        for ax, key in zip(axes, ("e2e", "ttft"), strict=True):
            values = sorted(per_request[key])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step([v * 1e3 for v in values], ys, where="post", label=result.target)
    for ax, title in zip(axes, ("E2E latency (ms)", "TTFT (ms)"), strict=True):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for result, run in results:
        if run.kv_samples:
            t0 = run.kv_samples[0].time_s
            ax.plot(
                [k.time_s - t0 for k in run.kv_samples],
                [100 * k.used_blocks / max(1, k.total_blocks) for k in run.kv_samples],
                label=result.target,
            )
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV blocks in use (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "kv_usage.png")
    fig.savefig(written[-1])
    plt.close(fig)
    return written
