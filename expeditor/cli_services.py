"""``expeditor serve``, ``scheduler`` and ``worker``: the daemons; ``keygen`` makes their
CURVE keys."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from expeditor.cli import app, fail, resolve_config
from expeditor.cli_options import (
    with_config_options,
    with_gateway_options,
    with_server_options,
)
from shared.errors import ConfigError
from shared.server_config import ServerConfig, load_server_config
from shared.swap_pool import SHM_DIR, remove_stale_segments

ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file with [server], [scheduler] and [gateway] tables."),
]


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _server(config_file: Path | None, overrides: dict[str, Any]) -> ServerConfig:
    try:
        server = load_server_config(config_file, overrides=overrides)
    except ConfigError as exc:
        fail(str(exc))
    from gpu_worker.model_source import locate_model

    try:
        locate_model(server.model)
    except ValueError as exc:
        fail(f"{exc}; or leave it empty for the tiny model")
    return server


SERVE_GATEWAY_FIELDS = (
    "api_key",
    "api_key_file",
    "served_model_name",
    "chat_template",
    "tool_call_parser",
    "max_body_bytes",
    "scheduler_timeout_s",
    "metrics_prefix",
    "ssl_certfile",
    "ssl_keyfile",
)
"""The [gateway] flags of serve (--http HOST:PORT stands for host and port)."""


@app.command()
@with_server_options()
@with_config_options
@with_gateway_options(SERVE_GATEWAY_FIELDS)
def serve(
    config: ConfigFile = None,
    http: Annotated[
        str | None,
        typer.Option(
            "--http",
            metavar="HOST:PORT",
            help="Also serve the OpenAI API over HTTP here (the [gateway] table's other "
            "settings apply), e.g. 127.0.0.1:8000.",
        ),
    ] = None,
    replica: Annotated[
        int | None,
        typer.Option(
            "--replica",
            metavar="INDEX",
            help="Run only replica INDEX of data_parallel_size (one systemd instance per "
            "replica): the given endpoints, KV event sockets and --http port offset by "
            "INDEX, its GPUs of CUDA_VISIBLE_DEVICES, its share of the cores.",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    *,
    server_overrides: dict[str, Any],
    config_overrides: dict[str, Any],
    gateway_overrides: dict[str, Any],
) -> None:
    """Start the scheduler and its workers, supervised; print the frontend address once
    ready to serve (and, with --http, the gateway's URL once it answers); stop everything
    on SIGINT/SIGTERM.

    Without --frontend the sockets live in a new private (0700) runtime directory.
    """
    _logging(verbose)
    from expeditor.cli_gateway import gateway_settings
    from gpu_worker.model_source import REGISTRY
    from ipc.curve import check_serve_keys
    from scheduler_svc.supervisor import run_serve
    from shared.gateway_config import parse_http_address

    gateway = None
    if http is not None:
        try:
            host, port = parse_http_address(http)
        except ConfigError as exc:
            fail(str(exc))
        gateway, _ = gateway_settings(config, {**gateway_overrides, "host": host, "port": port})
    elif any(value is not None for value in gateway_overrides.values()):
        fail("the gateway flags (--api-key, --chat-template ...) need --http HOST:PORT")
    server = _server(config, server_overrides)
    if gateway is not None and not gateway.served_model_name and server.model in REGISTRY:
        # A registry model is served under its name, not its converted directory's path.
        gateway = msgspec.structs.replace(gateway, served_model_name=server.model)
    if server.curve:
        try:
            check_serve_keys(
                server.curve_server_key, server.curve_client_key, server.curve_authorized_clients
            )
        except ConfigError as exc:
            fail(str(exc))
    if server.kv_events_connect and server.data_parallel_size > 1 and replica is None:
        fail(
            "kv_events_connect: the gateway in front of --data-parallel-size replicas "
            "follows each replica's own PUB socket; to connect every replica to one "
            "subscriber, run each as serve --replica INDEX (one systemd instance each)"
        )
    if replica is not None and not 0 <= replica < server.data_parallel_size:
        fail(
            f"--replica {replica}: not one of data_parallel_size {server.data_parallel_size} "
            f"replicas (0 .. {server.data_parallel_size - 1})"
        )
    raise typer.Exit(run_serve(server, resolve_config(config, config_overrides), gateway, replica))


@app.command()
@with_server_options()
@with_config_options
def scheduler(
    config: ConfigFile = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    *,
    server_overrides: dict[str, Any],
    config_overrides: dict[str, Any],
) -> None:
    """Run the scheduler daemon (speaks sd_notify: READY=1, WATCHDOG=1)."""
    _logging(verbose)
    from scheduler_svc.daemon import run_scheduler

    server = _server(config, server_overrides)
    if not server.frontend or not server.worker_endpoint:
        fail("the scheduler needs --frontend and --worker-endpoint (or the [server] table)")
    try:
        code = run_scheduler(server, resolve_config(config, config_overrides))
    except ConfigError as exc:
        fail(str(exc), code=1)
    raise typer.Exit(code)


@app.command()
@with_server_options(
    (
        "worker_endpoint",
        "device",
        "cpu_threads",
        "curve_server_key",
        "curve_client_key",
        "curve_authorized_clients",
        "insecure_tcp",
    )
)
def worker(
    rank: Annotated[int, typer.Option(help="This worker's rank (0..workers-1).")] = 0,
    config: ConfigFile = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    *,
    server_overrides: dict[str, Any],
) -> None:
    """Run one GPU worker: connect to the scheduler, load the model, run its plans."""
    _logging(verbose)
    server = _server(config, server_overrides)
    if not server.worker_endpoint:
        fail("the worker needs --worker-endpoint (or the [server] table)")
    if rank < 0:
        fail(f"--rank must be >= 0, got {rank}")
    from gpu_worker.daemon import run_worker

    raise typer.Exit(
        run_worker(
            rank,
            server.worker_endpoint,
            server.device,
            curve_server_key=server.curve_server_key,
            curve_client_key=server.curve_client_key,
            cpu_threads=server.cpu_threads,
        )
    )


@app.command()
def keygen(
    directory: Annotated[
        Path, typer.Argument(help="Where to write the certificate files (created 0700).")
    ],
    name: Annotated[
        str, typer.Option(help="Writes NAME.key (public) and NAME.key_secret (secret, 0600).")
    ] = "server",
) -> None:
    """Make a CURVE key pair (zmq certificate files) for the server, a worker or a client.

    Give the server NAME.key_secret as curve_server_key and its clients NAME.key; put each
    client's NAME.key into the server's curve_authorized_clients directory. Existing
    files are never overwritten.
    """
    from ipc.curve import create_key_pair

    try:
        public_file, secret_file = create_key_pair(directory, name)
    except ConfigError as exc:
        fail(str(exc))
    print(f"public key: {public_file}")
    print(f"secret key: {secret_file}")


@app.command("cleanup-shm")
def cleanup_shm(
    shm_dir: Annotated[Path, typer.Option(help="Where POSIX shared memory lives.")] = SHM_DIR,
) -> None:
    """Remove swap-pool segments left in /dev/shm by schedulers that died without
    cleaning up (SIGKILL, the OOM killer); print each one removed and the total.

    Only this user's segments whose owning process is gone are touched; safe to run at
    any time (the scheduler unit runs it as ExecStopPost=).
    """
    if not shm_dir.is_dir():
        fail(f"--shm-dir: {shm_dir} is not a directory")
    removed = remove_stale_segments(shm_dir)
    for segment in removed:
        print(f"removed {segment.name} ({segment.size} bytes)")
    total = sum(segment.size for segment in removed)
    print(f"removed {len(removed)} stale swap segment(s), {total} bytes")
