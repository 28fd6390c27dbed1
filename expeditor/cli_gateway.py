"""``expeditor gateway``: the OpenAI-compatible HTTP daemon in front of the scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from expeditor.cli import app, fail
from expeditor.cli_options import with_gateway_options, with_server_options
from shared.errors import ConfigError
from shared.gateway_config import GatewayConfig, load_gateway_config

ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file with [gateway] and [server] tables."),
]

GATEWAY_SERVER_FIELDS = (
    "frontend",
    "curve_server_key",
    "curve_client_key",
    "insecure_tcp",
    "shutdown_timeout_s",
    "max_prompt_bytes",
)
"""The [server] settings the gateway uses: how it reaches the scheduler, and how long
requests in flight get when it stops."""


def gateway_settings(
    config: Path | None, overrides: dict[str, Any]
) -> tuple[GatewayConfig, str | None]:
    """The [gateway] table and its API key; exits with the problem when either is bad."""
    try:
        settings = load_gateway_config(config, overrides=overrides)
        key = settings.read_api_key()
        if settings.chat_template and not Path(settings.chat_template).is_file():
            raise ConfigError(
                f"chat_template: {settings.chat_template} is not a file", field="chat_template"
            )
    except ConfigError as exc:
        fail(str(exc))
    return settings, key


@app.command()
@with_server_options(GATEWAY_SERVER_FIELDS)
@with_gateway_options()
def gateway(
    config: ConfigFile = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    *,
    server_overrides: dict[str, Any],
    gateway_overrides: dict[str, Any],
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics, /tokenize, /detokenize) over HTTP, in front of the scheduler at --frontend.

    Listens on 127.0.0.1:8000 by default; any other address needs an API key.
    """
    from expeditor.cli_services import _logging, _server
    from expeditor.gateway.discovery import kv_event_sources
    from expeditor.gateway.server import run_gateway
    from ipc.curve import client_curve_options

    _logging(verbose)
    server = _server(config, server_overrides)
    if not server.frontend:
        fail("the gateway needs --frontend (or the [server] table): the scheduler's address")
    settings, key = gateway_settings(config, gateway_overrides)
    curve: dict[str, bytes] = {}
    if server.curve:
        if not server.curve_client_key:
            fail("curve_client_key: the gateway needs a client key the scheduler admits")
        try:
            curve = client_curve_options(server.curve_server_key, server.curve_client_key)
        except ConfigError as exc:
            fail(str(exc))
    raise typer.Exit(
        run_gateway(
            server.frontend,
            settings,
            api_key=key,
            curve=curve,
            grace_s=server.shutdown_timeout_s,
            max_prompt_bytes=server.max_prompt_bytes,
            kv_event_sources=kv_event_sources(server, settings),
        )
    )
