"""Running the gateway: uvicorn with uvloop and httptools (the stack vLLM uses) serving
:func:`~expeditor.gateway.app.create_app`, with sd_notify READY=1 once it listens.

SIGTERM or SIGINT stops it gracefully: it stops accepting connections and gives open
ones ``GRACEFUL_STOP_S`` to finish (streams in flight end when the scheduler drains).
Under ``expeditor serve`` the supervisor stops the scheduler first.
"""

from __future__ import annotations

import logging
import os

import uvicorn

from expeditor.gateway.app import Gateway, create_app
from expeditor.gateway.http import RawSend
from shared.gateway_config import GatewayConfig

__all__ = ["run_gateway"]

log = logging.getLogger("expeditor.gateway")

GRACEFUL_STOP_S = 30


def _loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # not on every platform
        return "asyncio"
    return "uvloop"


class _NotifyingServer(uvicorn.Server):
    """Says READY=1 to systemd (when it started us with NOTIFY_SOCKET) once listening."""

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets=sockets)
        if self.started:
            from scheduler_svc.sdnotify import notify

            notify("READY=1")


def run_gateway(
    frontend: str,
    config: GatewayConfig,
    *,
    api_key: str | None,
    curve: dict[str, bytes] | None = None,
) -> int:
    """Serve until stopped; the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gateway = Gateway(frontend, config, api_key=api_key, curve=curve)
    server = _NotifyingServer(
        uvicorn.Config(
            RawSend(create_app(gateway)),
            host=config.host,
            port=config.port,
            loop=_loop(),
            http="httptools",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_STOP_S,
            server_header=False,
        )
    )
    log.info(
        "gateway on http://%s:%d for %s (API key %s)",
        config.host,
        config.port,
        frontend,
        "required" if api_key else "not required",
    )
    server.run()
    return 0 if server.started else 1
