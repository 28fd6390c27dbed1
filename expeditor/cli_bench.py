"""``expeditor bench``: a workload against several targets, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from expeditor.cli import app, fail
from expeditor.cli_client import step_times_line
from expeditor.cli_options import with_config_options

BENCH_HELP = """Run a workload against targets on the same checkpoint and report request
throughput, output tokens/s, TTFT, TPOT, ITL and E2E latency (mean, p50, p99), KV-cache
usage and waste, preemptions and prefix-cache hit rate.

Workloads (seeded, reproducible; exact distributions in expeditor/bench/workloads.py):
skewed (all at t=0, uniform prompts, exponential outputs with a cap, ignore_eos: the
case where static batching suffers head-of-line blocking); poisson (arrivals at
--rate per second with --burstiness, gamma inter-arrival times as in vLLM's serving
benchmark); shared-prefix (a few long shared system prompts, each followed by a
distinct suffix); pressure (a KV pool far smaller than the working set, forcing
preemption); json (all at t=0, each request constrained to a JSON schema of its own
from a seeded family; by default against expeditor and expeditor[constraints=off],
the same requests unconstrained, each generating as many tokens as it did
constrained); lookup (chat requests asking to repeat, edit or extend a passage of the
prompt, through the model's chat template: by default against expeditor and
expeditor[num_speculative_tokens=4], prompt lookup's gain); multi-turn (conversations
re-sending their histories through a device pool a third of their working set: by
default against expeditor and one with the prefix cache's host tier); long-context
(contexts 8x a sliding window through a pool a quarter of their whole contexts: by
default against expeditor and expeditor[free_out_of_window_blocks=false], what giving
back the blocks behind the window buys); or a JSONL file of
requests ({"prompt_token_ids" | "prompt_len", "max_tokens", "arrival_s"}).

Targets: expeditor (the daemons via the client library, streaming); inprocess (the
in-process engine); static (transformers generate on padded batches of max_num_seqs,
each until its longest request ends); hf-cb (transformers' own continuous batching);
openai:URL (any OpenAI-compatible server already running, e.g. expeditor serve --http,
vLLM, transformers serve: streamed over HTTP, TTFT/ITL as its client sees them).
A target may carry scheduler overrides: --target 'expeditor[preemption_mode=swap]'. An
openai target takes options instead: api=completions|chat (token-id prompts with
ignore_eos, or chat messages of the decoded prompts), model= (default: the first of
GET /v1/models), api_key= (default $EXPEDITOR_API_KEY or $OPENAI_API_KEY),
max_concurrency= (default: every request at its arrival time), e.g.
--target 'openai:http://127.0.0.1:8000[api=chat,max_concurrency=8]'.
"""


DEFAULT_TARGETS = {
    "json": ["expeditor", "expeditor[constraints=off]"],
    "lookup": ["expeditor", "expeditor[num_speculative_tokens=4]"],
    "multi-turn": ["expeditor", "expeditor[num_cpu_blocks=512,prefix_cache_cpu_blocks=512]"],
    "long-context": ["expeditor[free_out_of_window_blocks=false]", "expeditor"],
}
"""Workloads' targets unless --target says: what they measure, side by side (the cost
of constraints; the gain of prompt lookup). Others: expeditor and static."""


@app.command(help=BENCH_HELP)
@with_config_options
def bench(
    workload: Annotated[
        str,
        typer.Option(
            help="skewed | poisson | shared-prefix | pressure | json | lookup | multi-turn | "
            "long-context | FILE.jsonl"
        ),
    ] = "skewed",
    workload_arg: Annotated[
        list[str] | None,
        typer.Option(
            help="KEY=VALUE for the workload's generator, VALUE as JSON (e.g. "
            "num_prefixes=16, suffix_len=[8,32]); repeatable."
        ),
    ] = None,
    target: Annotated[
        list[str] | None,
        typer.Option(
            help="expeditor | inprocess | static | hf-cb | openai:URL, optionally "
            "NAME[k=v,...]; repeatable."
        ),
    ] = None,
    num_requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 64,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    rate: Annotated[float | None, typer.Option(help="poisson: requests per second.")] = None,
    burstiness: Annotated[
        float | None, typer.Option(help="poisson: gamma shape (1 = Poisson).")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Checkpoint directory, GGUF file or registry model name "
            "(smollm2-135m-instruct), or tiny | small: an embedded preset (default tiny)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "cpu",
    dtype: Annotated[
        str,
        typer.Option(
            help="auto | float32 | bfloat16 | float16, for every target but openai "
            "(auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AMX)."
        ),
    ] = "auto",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write PNG charts into this directory.")] = None,
    *,
    config_overrides: dict[str, Any],
) -> None:
    from expeditor.bench.run import parse_target, report_json, run_bench, write_plots
    from expeditor.bench.targets import TargetError
    from expeditor.bench.workloads import make_workload

    if num_requests < 1:
        fail("--num-requests must be >= 1")
    try:
        default = DEFAULT_TARGETS.get(workload, ["expeditor", "static"])
        specs = [parse_target(t) for t in (target or default)]
    except ValueError as exc:
        fail(escape(str(exc)))
    checkpoint = _checkpoint(model)
    try:
        extra: dict[str, Any] = {
            k: v for k, v in (("rate", rate), ("burstiness", burstiness)) if v is not None
        }
        extra.update(_workload_args(workload_arg or []))
        if workload == "lookup":
            extra["model"] = checkpoint  # its prompts are the model's chat
        load = make_workload(workload, num_requests, seed, **extra)
    except (ValueError, OSError) as exc:
        fail(escape(str(exc)))
    base = {k: v for k, v in config_overrides.items() if v is not None}
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=json_output,
    ) as progress:
        tasks = {
            s.label: progress.add_task(escape(s.label), total=len(load.requests), start=False)
            for s in specs
        }
        try:
            results = run_bench(
                load,
                specs,
                model=checkpoint,
                base_config=base,
                device=device,
                dtype=dtype,
                on_done=lambda label: progress.advance(tasks[label]),
                on_start=lambda label: progress.start_task(tasks[label]),
            )
        except (ValueError, TargetError) as exc:
            fail(escape(str(exc)))
    if json_output:
        print(report_json(load, [r for r, _ in results], seed=seed, model=checkpoint))
    else:
        out = Console()
        out.width = max(out.width, 150)  # the table has a dozen columns
        out.print(results_table(load.name, load.description, [r for r, _ in results]))
        for result, _ in results:
            if result.step_ms is not None:
                out.print(
                    f"{result.target}: {step_times_line(result.step_ms)}",
                    highlight=False,
                    markup=False,
                )
            for note in result.notes:
                out.print(f"{result.target}: {note}", highlight=False, markup=False)
            out.print(
                f"{result.target}: at most {result.peak_concurrency} requests generating at once",
                highlight=False,
                markup=False,
            )
    if plot is not None:
        for path in write_plots(results, plot):
            console.print(f"wrote {path}")


def _checkpoint(model: str | None) -> Path:
    """--model: a preset name (the cached embedded model of that size), or what serve's
    --model takes (a directory, a GGUF file, a registry model name), resolved here.

    A directory named like a preset is given with a path prefix (``./small``).
    """
    from gpu_worker.model_source import locate_model, resolve_model
    from gpu_worker.tiny_model import DEFAULT_SIZE, SIZES, default_model_dir

    if model is None or model in SIZES:
        return default_model_dir(model or DEFAULT_SIZE)
    try:
        kind, _ = locate_model(model)
    except ValueError:
        return Path(model)  # the targets say what is wrong with it
    if kind not in ("registry", "gguf"):
        return Path(model)
    try:
        return resolve_model(model)
    except ValueError as exc:
        fail(escape(str(exc)))


def _workload_args(items: list[str]) -> dict[str, Any]:
    """``--workload-arg`` values: KEY=VALUE with VALUE as JSON (a list is a tuple)."""
    args: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--workload-arg {item!r}: expected KEY=VALUE")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text  # a plain string
        args[key.strip().replace("-", "_")] = tuple(value) if isinstance(value, list) else value
    return args


def _ms(summary: dict[str, float] | None, *keys: str) -> str:
    if summary is None:
        return "-"
    return " / ".join(f"{summary[k]:.1f}" if summary[k] < 10 else f"{summary[k]:.0f}" for k in keys)


def results_table(name: str, description: str, results: list[Any]) -> Table:
    table = Table(title=f"{name}: {description}", title_justify="left")
    for column in (
        "target",
        "req/s",
        "out tok/s",
        "vs first",
        "TTFT ms mean/p99",
        "TPOT ms",
        "ITL ms",
        "E2E ms mean/p99",
        "KV use",
        "KV waste",
        "preempted",
        "prefix hit",
    ):
        table.add_column(column, justify="right" if column != "target" else "left")
    base = results[0].output_throughput if results else 0.0
    for r in results:
        kv = r.kv or {}
        table.add_row(
            escape(r.target),
            f"{r.request_throughput:.2f}",
            f"{r.output_throughput:.0f}",
            f"{r.output_throughput / base:.2f}x" if base else "-",
            _ms(r.ttft_ms, "mean", "p99"),
            _ms(r.tpot_ms, "mean"),
            _ms(r.itl_ms, "mean"),
            _ms(r.e2e_ms, "mean", "p99"),
            f"{kv['mean_usage']:.0%}" if "mean_usage" in kv else "-",
            f"{kv['mean_waste']:.1%}" if "mean_waste" in kv else "-",
            ", ".join(f"{k} {v}" for k, v in (r.preemptions or {}).items()) or "-",
            f"{r.prefix_cache_hit_rate:.0%}" if r.prefix_cache_hit_rate is not None else "-",
        )
    return table
