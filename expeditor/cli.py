"""The ``expeditor`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import msgspec
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from expeditor.cli_options import with_config_options
from gpu_worker.tiny_model import ARCHS  # names only: the module loads torch lazily
from scheduler_svc.simulator import DEFAULT_KV_BYTES_PER_BLOCK, Simulation, TraceError, load_trace
from scheduler_svc.traces import generate_trace, write_trace
from shared.config import SchedulerConfig, load_config
from shared.errors import ConfigError

app = typer.Typer(
    help="expeditor: continuous-batching LLM serving with a CPU-only scheduler daemon.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

DEFAULT_SIM_GPU_BLOCKS = 4096


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error to stderr and exit (2: bad input)."""
    # escape(): a message naming a settings table ("[server] ...") is not rich markup.
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(code)


def resolve_config(config_file: Path | None, overrides: dict[str, Any]) -> SchedulerConfig:
    try:
        return load_config(config_file, overrides=overrides)
    except ConfigError as exc:
        fail(str(exc))


def _parse_range(text: str, name: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition(":")
        return int(low), int(high or low)
    except ValueError:
        fail(f"{name}: expected LOW:HIGH integers, got {text!r}")


def _parse_ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        fail(f"{name}: expected comma-separated integers, got {text!r}")


@app.command()
@with_config_options
def simulate(
    trace: Annotated[Path, typer.Option(help="Trace file, JSON Lines: one request a line.")],
    steps_out: Annotated[
        Path | None, typer.Option(help="Write one JSON object per step to this file.")
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the summary as one JSON object.")
    ] = False,
    config: Annotated[
        Path | None, typer.Option(help="TOML config file ([scheduler] table).")
    ] = None,
    kv_bytes_per_block: Annotated[
        int, typer.Option(help="Bytes of one KV block, for the swap-vs-recompute cost model.")
    ] = DEFAULT_KV_BYTES_PER_BLOCK,
    verify_kv: Annotated[
        bool, typer.Option(help="Have the fake worker check every K/V slot it reads (slow).")
    ] = False,
    check_invariants: Annotated[
        bool,
        typer.Option(
            help="Check the scheduler's invariants after every plan and update (the summary's "
            "invariants_ok: true; null when off). Off by default: the checks walk the whole "
            "block pool and prefix cache between the timed calls, which slows the calls "
            "step_time_us times."
        ),
    ] = False,
    proposal_acceptance: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="With --num-speculative-tokens: decodes propose tokens that are the fake "
            "model's with this probability (unset: prompt lookup, as served).",
        ),
    ] = None,
    kv_window: Annotated[
        int,
        typer.Option(
            min=0,
            help="The fake model's sliding window on every layer (a worker's hello says "
            "it for such a model): blocks behind it are given back "
            "(free_out_of_window_blocks); 0 = every layer reads the whole context.",
        ),
    ] = 0,
    kv_groups: Annotated[
        str,
        typer.Option(
            help="The fake model's layer groups, a window each (0: full attention), "
            "comma-separated, e.g. 0,256 (as a worker's hello says for a model that "
            "mixes windowed and full layers): a table holds every group's blocks, the "
            "windowed groups' given back behind the window; empty = one group.",
        ),
    ] = "",
    *,
    config_overrides: dict[str, Any],
) -> None:
    """Replay a request trace through the real scheduler core and a fake worker.

    Trace line: {"id": str, "arrival_step": int, "prompt_len": int | "prompt_token_ids":
    [int], "max_tokens": int, "priority": int (lower runs first), "n": int, "eos_at": int
    (the k-th output token is EOS), "abort_step": int}. num_gpu_blocks defaults to 4096.
    """
    cfg = resolve_config(config, config_overrides)
    if cfg.num_gpu_blocks is None:
        cfg = msgspec.structs.replace(cfg, num_gpu_blocks=DEFAULT_SIM_GPU_BLOCKS)
    try:
        requests = load_trace(trace)
    except TraceError as exc:
        fail(str(exc))
    on_step = close = None
    if steps_out is not None:
        handle = steps_out.open("w")

        def on_step(record: dict[str, Any]) -> None:
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")

        close = handle.close
    try:
        groups = tuple(int(w) for w in kv_groups.split(",")) if kv_groups.strip() else ()
    except ValueError:
        fail(f"--kv-groups {kv_groups!r}: comma-separated windows (integers), e.g. 0,256")
    if len(groups) == 1 or any(w < 0 for w in groups) or (groups and kv_window):
        fail(
            f"--kv-groups {kv_groups!r}: at least two windows, none negative, and not "
            "with --kv-window (a one-group cache)"
        )
    sim = Simulation(
        requests,
        cfg,
        kv_bytes_per_block=kv_bytes_per_block,
        verify_kv=verify_kv,
        check_invariants=check_invariants,
        proposal_acceptance=proposal_acceptance,
        kv_window=kv_window,
        kv_groups=groups,
    )
    try:
        result = sim.run(on_step)
    except AssertionError as exc:
        fail(f"invariant violated: {exc}", code=1)
    finally:
        if close is not None:
            close()
    summary = result.summary
    if json_output:
        print(json.dumps(summary))
        return
    table = Table(title=f"simulation of {trace.name}", show_header=False)
    for key, value in summary.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    Console().print(table)
    if summary["invariants_ok"] is False:
        sys.exit(1)


@app.command("make-trace")
def make_trace(
    out: Annotated[Path, typer.Argument(help="Trace file to write (JSON Lines).")],
    num_requests: Annotated[int, typer.Option(help="Number of requests.")] = 1000,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    prompt_len: Annotated[str, typer.Option(help="Prompt length range LOW:HIGH.")] = "32:1024",
    output_len: Annotated[str, typer.Option(help="Output length range LOW:HIGH.")] = "16:512",
    arrival_rate: Annotated[
        float, typer.Option(help="Poisson arrivals per step; 0 = all at step 0.")
    ] = 0.0,
    priorities: Annotated[str, typer.Option(help="Priorities to draw from, e.g. 0,1,2.")] = "0",
    n: Annotated[str, typer.Option(help="Sample counts to draw from, e.g. 1,2.")] = "1",
    eos_fraction: Annotated[float, typer.Option(help="Share of requests ending at EOS.")] = 0.0,
    abort_fraction: Annotated[float, typer.Option(help="Share aborted by the client.")] = 0.0,
    shared_prefixes: Annotated[
        int, typer.Option(help="Number of common prompt prefixes (0 = none).")
    ] = 0,
    shared_prefix_len: Annotated[int, typer.Option(help="Tokens per shared prefix.")] = 256,
) -> None:
    """Write a seeded synthetic trace for `expeditor simulate`."""
    try:
        trace = generate_trace(
            num_requests,
            seed=seed,
            prompt_len=_parse_range(prompt_len, "--prompt-len"),
            output_len=_parse_range(output_len, "--output-len"),
            arrival_rate=arrival_rate or None,
            priorities=_parse_ints(priorities, "--priorities"),
            n_choices=_parse_ints(n, "--n"),
            eos_fraction=eos_fraction,
            abort_fraction=abort_fraction,
            shared_prefixes=shared_prefixes,
            shared_prefix_len=shared_prefix_len,
        )
    except ValueError as exc:
        fail(str(exc))
    write_trace(trace, out)
    Console(stderr=True).print(f"wrote {len(trace)} requests to {out}")


@app.command("make-tiny-model")
def make_tiny_model_cmd(
    out: Annotated[Path, typer.Argument(help="Checkpoint directory to write.")],
    arch: Annotated[
        Literal[ARCHS],  # type: ignore[valid-type]  # the names, as typer's choices
        typer.Option(
            help="Model architecture (gemma3: Gemma 3's text model). mistral, qwen2, gemma2 "
            "and gemma3 have sliding-window layers (22 tokens)."
        ),
    ] = "llama",
    seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
    size: Annotated[
        Literal["tiny", "small"],
        typer.Option(help="Preset: tiny (2 layers, hidden 64) or small (4 layers, hidden 256)."),
    ] = "tiny",
) -> None:
    """Write a deterministic random-weight Hugging Face checkpoint (no download).

    Byte-level tokenizer. tiny (2 layers, hidden size 64, ~0.1M parameters): for tests and
    smoke runs; small (4 layers, hidden 256, GQA 8/2 heads, ~4M parameters): a forward step
    that costs something, for benchmarks. OUT may be absent, empty or an earlier such model
    (replaced).
    """
    from gpu_worker.tiny_model import make_tiny_model  # lazy: torch only for this command

    try:
        path = make_tiny_model(out, arch=arch, seed=seed, size=size)
    except (FileExistsError, ValueError) as exc:
        fail(str(exc))
    Console(stderr=True, soft_wrap=True).print(
        f"wrote {size} {arch} model (seed {seed}) to {path}", highlight=False, markup=False
    )


# The daemon and client commands live in their own modules; importing them registers
# them on ``app``.
from expeditor import cli_bench, cli_chat, cli_client, cli_gateway, cli_services  # noqa: E402, F401


def main() -> None:
    app()
