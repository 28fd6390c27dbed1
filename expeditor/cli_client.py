"""``expeditor generate`` and ``expeditor inspect``: client commands over the frontend."""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from expeditor.cli import app, fail
from ipc.errors import UNREACHABLE, ServerUnavailableError
from ipc.schema import InspectReply, StepTimes
from shared.errors import ConfigError, InvalidRequestError
from shared.server_config import check_endpoint

Address = Annotated[
    str,
    typer.Option(
        "--address",
        envvar="EXPEDITOR_ADDRESS",
        help="The server's frontend (printed by `expeditor serve`), e.g. ipc:///run/expeditor/frontend.sock.",
    ),
]
TimeoutSeconds = Annotated[float, typer.Option(help="Seconds to wait for the server.")]
CurveServerKey = Annotated[
    str,
    typer.Option(
        "--curve-server-key",
        envvar="EXPEDITOR_CURVE_SERVER_KEY",
        metavar="FILE",
        help="The server's certificate (its NAME.key) when it uses CURVE.",
    ),
]
CurveClientKey = Annotated[
    str,
    typer.Option(
        "--curve-client-key",
        envvar="EXPEDITOR_CURVE_CLIENT_KEY",
        metavar="FILE",
        help="This client's secret certificate (NAME.key_secret from `expeditor keygen`); "
        "its public key must be in the server's curve_authorized_clients.",
    ),
]


def _client_options(
    address: str, server_key: str, client_key: str, timeout: float
) -> dict[str, bytes]:
    """Check the address and the timeout; the CURVE keyword arguments for the client
    (none without keys)."""
    from ipc.curve import client_curve_options

    if not (timeout > 0 and math.isfinite(timeout)):
        fail(f"--timeout must be a positive number of seconds, got {timeout}")
    if not address:
        fail("--address is required (or set EXPEDITOR_ADDRESS)")
    if bool(server_key) != bool(client_key):
        fail("give --curve-server-key and --curve-client-key together (or neither)")
    try:
        # Loopback tcp:// without keys is let through: the server may run insecure_tcp.
        check_endpoint(
            "--address",
            address,
            curve=bool(server_key),
            insecure_tcp=True,
            curve_hint="give --curve-server-key and --curve-client-key",
        )
        return client_curve_options(server_key, client_key) if server_key else {}
    except ConfigError as exc:
        fail(str(exc))


@app.command()
def generate(
    address: Address,
    prompt: Annotated[str | None, typer.Argument(help="Prompt text.")] = None,
    token_ids: Annotated[
        str | None, typer.Option(help="Prompt as comma-separated token ids instead of text.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    n: Annotated[int, typer.Option(help="Number of samples.")] = 1,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    priority: Annotated[int, typer.Option(help="Lower runs first (priority policy).")] = 0,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it comes.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    timeout: TimeoutSeconds = 300.0,
    curve_server_key: CurveServerKey = "",
    curve_client_key: CurveClientKey = "",
) -> None:
    """Send one request and print its completion."""
    from ipc.client import Client
    from ipc.errors import ServerError

    curve = _client_options(address, curve_server_key, curve_client_key, timeout)
    if (prompt is None) == (token_ids is None):
        fail("give a prompt or --token-ids (exactly one)")
    ids = None
    if token_ids is not None:
        try:
            ids = [int(t) for t in token_ids.split(",")]
        except ValueError:
            fail(f"--token-ids: expected comma-separated integers, got {token_ids!r}")
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "n": n,
        "stop": tuple(stop or ()),
    }
    try:
        with Client(address, timeout=timeout, **curve) as client:
            if stream:
                events = client.stream(prompt, prompt_token_ids=ids, priority=priority, **sampling)
                for delta in events:
                    if json_output:
                        print(json.dumps(msgspec.to_builtins(delta)), flush=True)
                    elif n > 1:  # the samples' pieces interleave: each on a line, labelled
                        if delta.text:
                            print(f"[{delta.index}] {delta.text!r}", flush=True)
                    else:
                        print(delta.text, end="", flush=True)
                completion = events.completion
                if not json_output:
                    print()
            else:
                completion = client.generate(
                    prompt, prompt_token_ids=ids, priority=priority, **sampling
                )
    except InvalidRequestError as exc:
        fail(str(exc))
    except ServerError as exc:
        fail(f"server refused: {exc}", code=1)
    except UNREACHABLE as exc:
        fail(_unreachable(exc, address), code=1)
    if completion is None:
        return
    if json_output:
        print(json.dumps(msgspec.to_builtins(completion)))
    elif not stream:
        for sample in completion.samples:
            prefix = f"[{sample.index}] " if len(completion.samples) > 1 else ""
            print(f"{prefix}{sample.text}")
    if not json_output:
        t = completion.timings
        Console(stderr=True).print(
            f"{completion.finish_reason}: {completion.usage.completion_tokens} tokens, "
            f"queue {t.queue_s * 1e3:.0f} ms, TTFT {t.ttft_s * 1e3:.0f} ms, "
            f"total {t.total_s * 1e3:.0f} ms",
            highlight=False,
        )


def inspect_json(reply: InspectReply) -> dict[str, Any]:
    """The documented ``inspect --json`` object (docs/architecture.md)."""
    return msgspec.to_builtins(
        {
            "model": reply.model,
            "frontend": reply.frontend,
            "workers": reply.workers,
            "config": reply.config,
            "scheduler": reply.snapshot,
            "step_times": reply.step_times,
            "step_times_total": reply.step_times_total,
        }
    )


def plain(value: str) -> Text:
    """Text a client chose (a request id) as it is: no rich markup, and control
    characters written as escapes rather than sent to the operator's terminal."""
    shown = (c if c.isprintable() else c.encode("unicode_escape").decode() for c in value)
    return Text("".join(shown))


def render(reply: InspectReply) -> Group:
    summary = Table(title=f"expeditor at {reply.frontend}", show_header=False)
    summary.add_row("model", reply.model or "(waiting for a worker)")
    snap = reply.snapshot
    if snap is not None:
        gpu, cpu = snap.gpu_blocks, snap.cpu_blocks
        summary.add_row("step", str(snap.step))
        summary.add_row(
            "queues",
            f"{snap.num_running} running, {snap.num_waiting} waiting, {snap.num_swapped} swapped",
        )
        summary.add_row(
            "GPU blocks",
            f"{gpu.total - gpu.free}/{gpu.total} used, {gpu.cached} free but cached",
        )
        summary.add_row("CPU blocks", f"{cpu.total - cpu.free}/{cpu.total} used")
        summary.add_row(
            "prefix cache",
            f"{snap.prefix_cache.hit_rate:.1%} of {snap.prefix_cache.queried_tokens} "
            "prompt tokens hit",
        )
        cache = snap.prefix_cache
        if cache.host_blocks:
            summary.add_row(
                "host tier",
                f"{cache.host_cached_blocks}/{cache.host_blocks} blocks hold prefixes, "
                f"{cache.host_hit_tokens} prompt tokens copied back",
            )
        summary.add_row("preemptions", ", ".join(f"{k} {v}" for k, v in snap.preemptions.items()))
        summary.add_row("finished", ", ".join(f"{k} {v}" for k, v in snap.finished.items()))
    if reply.step_times is not None:
        summary.add_row("step ms", step_times_line(reply.step_times))
    group = max((w.group_size for w in reply.workers), default=1)
    title = f"workers: one tensor-parallel group of {group} ranks" if group > 1 else "workers"
    workers = Table(title=title)
    for column in ("rank", "pid", "device", "state", "KV blocks"):
        workers.add_column(column)
    for w in reply.workers:
        workers.add_row(str(w.rank), str(w.pid), w.device, w.state, str(w.num_gpu_blocks or "-"))
    seqs = Table(title="sequences")
    for column in (
        "id",
        "state",
        "prio",
        "prompt",
        "output",
        "computed",
        "GPU blk",
        "CPU blk",
        "preempted",
    ):
        seqs.add_column(column)
    for info in snap.seqs if snap is not None else []:
        seqs.add_row(
            plain(info.seq_id),
            info.state,
            str(info.priority),
            str(info.num_prompt_tokens),
            str(info.num_output_tokens),
            str(info.num_computed_tokens),
            str(info.num_gpu_blocks),
            str(info.num_cpu_blocks),
            str(info.num_preemptions),
        )
    return Group(summary, workers, seqs)


@app.command()
def inspect(
    address: Address,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    watch: Annotated[
        float | None, typer.Option(help="Refresh every this many seconds until Ctrl-C.")
    ] = None,
    timeout: TimeoutSeconds = 10.0,
    curve_server_key: CurveServerKey = "",
    curve_client_key: CurveClientKey = "",
) -> None:
    """Show a live server's state: queues, requests, block usage, prefix cache, workers."""
    from ipc.client import Client
    from ipc.errors import ServerError

    curve = _client_options(address, curve_server_key, curve_client_key, timeout)
    if watch is not None and not (watch > 0 and math.isfinite(watch)):
        fail(f"--watch must be a positive number of seconds, got {watch}")
    try:
        with Client(address, timeout=timeout, **curve) as client:
            if watch is None:
                reply = client.inspect()
                if json_output:
                    print(json.dumps(inspect_json(reply)))
                else:
                    Console().print(render(reply))
                return
            if json_output:
                while True:
                    print(json.dumps(inspect_json(client.inspect())), flush=True)
                    time.sleep(watch)
            with Live(render(client.inspect()), refresh_per_second=4) as live:
                while True:
                    time.sleep(watch)
                    live.update(render(client.inspect()))
    except KeyboardInterrupt:
        return
    except ServerError as exc:
        fail(f"server refused: {exc}", code=1)
    except UNREACHABLE as exc:
        fail(_unreachable(exc, address), code=1)


def _unreachable(exc: Exception, address: str) -> str:
    """What to say of a server that is not there or did not answer."""
    if isinstance(exc, ServerUnavailableError):
        return str(exc)  # its message asks whether the server runs
    return f"{exc} (is the server at {address} running?)"


def step_times_line(times: StepTimes) -> str:
    """``schedule 0.21 · transfer 0.35 · ... ms per step (N steps)``, for the tables."""
    parts = ("schedule", "transfer", "prepare", "swap", "forward", "sample", "outputs")
    values = " · ".join(f"{name} {getattr(times, name):.2f}" for name in parts)
    rate = f"; forward {times.forward_gflops:.1f} GFLOP/s" if times.forward_gflops else ""
    return f"{values} ms per step ({times.steps} steps){rate}"
