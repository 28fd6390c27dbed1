"""Running the gateway: uvicorn with uvloop and httptools (the stack vLLM uses) serving
:func:`~expeditor.gateway.app.create_app`, with sd_notify READY=1 once it listens.

Connections are guarded by :mod:`expeditor.gateway.transport` (read deadlines for
heads and bodies, a bounded head, a connection cap under the open-file limit).

SIGTERM or SIGINT stops it gracefully: it stops accepting connections, answers 503 to
new requests on open ones, and gives the requests in flight ``grace_s`` (the
``[server]`` ``shutdown_timeout_s``) to finish; streams still open then end with an
error event and ``[DONE]``, and their scheduler requests are aborted. Under
``expeditor serve`` (and with the systemd units' ordering) the scheduler stops first:
it drains, so the streams end normally before the gateway is asked to stop.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

import uvicorn

from expeditor.gateway.app import MAX_PROMPT_BYTES, Gateway, create_app
from expeditor.gateway.http import RawSend
from expeditor.gateway.transport import TransportLimits, guarded_protocol, reserve_open_files
from shared.errors import ConfigError
from shared.gateway_config import GatewayConfig

__all__ = ["run_gateway"]

log = logging.getLogger("expeditor.gateway")


def _loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # not on every platform
        return "asyncio"
    return "uvloop"


class _GatewayServer(uvicorn.Server):
    """uvicorn, saying READY=1 to systemd (when it started us with NOTIFY_SOCKET) once
    listening, and draining the gateway's requests before uvicorn's own shutdown (which
    would cut streams after its timeout, with no error event)."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, grace_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.grace_s = grace_s

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets=sockets)
        if self.started:
            from scheduler_svc.sdnotify import notify

            config = self.gateway.config
            log.info(
                "gateway on %s://%s:%d for %s (API key %s)",
                "https" if config.ssl_certfile else "http",
                config.host,
                config.port,
                self.gateway.frontend,
                "required" if self.gateway.api_key else "not required",
            )
            notify("READY=1")

    async def shutdown(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        for server in self.servers:
            server.close()  # no new connections while the requests in flight finish
        await self.gateway.drain(self.grace_s)
        await super().shutdown(sockets=sockets)
        # uvicorn re-raises the stop signal once shut down (dying by SIGTERM); a drained
        # gateway exits 0 instead, as the scheduler does.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def _check_tls(certfile: str, keyfile: str) -> None:
    """The certificate and key load (else a ConfigError naming them, before listening)."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"ssl_certfile/ssl_keyfile: cannot load {certfile} with {keyfile}: {exc}",
            field="ssl_certfile",
        ) from None


def run_gateway(
    frontend: str,
    config: GatewayConfig,
    *,
    api_key: str | None,
    curve: dict[str, bytes] | None = None,
    grace_s: float = 30.0,
    max_prompt_bytes: int = MAX_PROMPT_BYTES,
    kv_event_sources: dict[str, dict[str, Any]] | None = None,
) -> int:
    """Serve until stopped; the exit status (2 at once, the problem logged, when
    ``max_connections`` does not fit under the open-file limit)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        reserve_open_files(config.max_connections)
        if config.ssl_certfile:
            _check_tls(config.ssl_certfile, config.ssl_keyfile)
    except ConfigError as exc:
        log.error("[gateway] %s", exc)
        return 2
    gateway = Gateway(
        frontend,
        config,
        api_key=api_key,
        curve=curve,
        max_prompt_bytes=max_prompt_bytes,
        kv_event_sources=kv_event_sources,
    )
    server = _GatewayServer(
        uvicorn.Config(
            RawSend(create_app(gateway)),
            host=config.host,
            port=config.port,
            loop=_loop(),
            http=guarded_protocol(TransportLimits.of(config)),
            ws="none",  # no WebSocket routes: an upgrade request is answered as plain HTTP
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,  # after drain(): what is left is stuck
            server_header=False,
            ssl_certfile=config.ssl_certfile or None,
            ssl_keyfile=config.ssl_keyfile or None,
        ),
        gateway,
        grace_s,
    )
    server.run()
    return 0 if server.started else 1
