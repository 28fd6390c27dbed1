"""The gateway's HTTP/1.1 connections against hostile clients: uvicorn's httptools
protocol with the limits uvicorn lacks.

- **Read deadlines.** A request head (request line and headers) must arrive within
  ``header_timeout_s`` of the connection opening or of the previous response; a body
  within ``body_timeout_s`` of its head. Otherwise the client gets 408 and the
  connection is closed (uvicorn's ``timeout_keep_alive`` only covers a connection that
  sends nothing at all: one byte now and then kept it open forever).
- **Head size.** The head's bytes are counted as they arrive, before the parser sees
  them (httptools buffers a header line by repeated concatenation: quadratic time);
  beyond ``max_header_bytes``, or past ``max_header_count`` header lines, the client
  gets 431 and the connection is closed.
- **Write deadline.** A client that stops reading its response (a stream it never
  takes) fills the socket's buffer; writing stays paused. Paused for longer than
  ``send_timeout_s``, the connection is closed (the stream's request is aborted as for
  a disconnect, and what it held is freed).
- **Connections.** Beyond ``max_connections`` open ones, a new connection gets 503 and
  is closed at once, so idle connections cannot take every file descriptor;
  :func:`reserve_open_files` makes sure the cap fits under the open-file limit.

Refusals are OpenAI error objects, written straight to the transport and logged at
debug level only (a flood of them must not flood the log either).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from expeditor.gateway.responses import error_body, json_bytes
from shared.errors import ConfigError
from shared.gateway_config import GatewayConfig

__all__ = [
    "FD_HEADROOM",
    "TransportLimits",
    "guarded_protocol",
    "reserve_open_files",
]

log = logging.getLogger("expeditor.gateway")

FD_HEADROOM = 64
"""File descriptors kept beyond ``max_connections`` for everything else the gateway
opens: the listening sockets, the scheduler connection, the event loop, the tokenizer's
files, logging."""


@dataclass(frozen=True)
class TransportLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 100
    max_connections: int = 1000
    send_timeout_s: float = 30.0

    @classmethod
    def of(cls, config: GatewayConfig) -> TransportLimits:
        return cls(
            header_timeout_s=config.header_timeout_s,
            body_timeout_s=config.body_timeout_s,
            max_header_bytes=config.max_header_bytes,
            max_header_count=config.max_header_count,
            max_connections=config.max_connections,
            send_timeout_s=config.send_timeout_s,
        )


def reserve_open_files(max_connections: int) -> int:
    """Make room for ``max_connections`` connections plus :data:`FD_HEADROOM` under the
    open-file limit (RLIMIT_NOFILE), raising the soft limit towards the hard one if
    needed; the soft limit then. ConfigError naming the field when even the hard limit
    is too low."""
    needed = max_connections + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    refusal = ConfigError(
        f"max_connections: {max_connections} connections need {needed} open files "
        f"({FD_HEADROOM} beyond the connections), but the open-file limit is "
        f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}; lower "
        "max_connections or raise the limit (LimitNOFILE= in the systemd unit, ulimit -n)",
        field="max_connections",
    )
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise refusal
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (ValueError, OSError):  # beyond the kernel's own ceiling (fs.nr_open)
        raise refusal from None
    return needed


class _TooManyHeaders(Exception):
    """Raised from the parser callback to stop parsing a head with too many lines."""


def _response(status: int, message: str, kind: str) -> bytes:
    body = json_bytes(error_body(message, kind, status))
    return b"".join(
        [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines, a bounded head and a connection
    cap (see the module docstring). The limits are a class attribute: uvicorn builds one
    protocol per connection from the class (see :func:`guarded_protocol`)."""

    limits: ClassVar[TransportLimits] = TransportLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        self._in_head = True
        """The parser is reading a request head (or waits for one)."""
        self._in_body = False
        """The parser is reading a request body."""
        self._head_bytes = 0
        self._header_count = 0

    # -- deadlines ----------------------------------------------------------------------

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _arm(self) -> None:
        """Set the deadline for what the connection waits for now: a body being read, or
        the next head once no response is in progress (while a response is being made
        the client legitimately sends nothing)."""
        self._disarm()
        if self.transport is None or self.transport.is_closing():
            return
        if self._in_body:
            delay, what = self.limits.body_timeout_s, "body"
        elif self.cycle is None or self.cycle.response_complete:
            delay, what = self.limits.header_timeout_s, "head"
        else:
            return
        self._deadline = self.loop.call_later(delay, self._expired, what)

    def _expired(self, what: str) -> None:
        self._deadline = None
        field = "header_timeout_s" if what == "head" else "body_timeout_s"
        limit = getattr(self.limits, field)
        self._refuse(
            408,
            f"the request {what} did not arrive within {field}={limit:g} s",
            "RequestTimeoutError",
        )

    def _refuse(self, status: int, message: str, kind: str) -> None:
        """Answer ``status`` (unless a response is already under way) and close."""
        self._disarm()
        if self.transport.is_closing():
            return
        log.debug("%s:%s refused with %d: %s", *(self.client or ("?", 0)), status, message)
        cycle = self.cycle
        if cycle is None or not cycle.response_started or cycle.response_complete:
            self.transport.write(_response(status, message, kind))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's later sends go nowhere
            cycle.message_event.set()
        self.transport.close()

    # -- the connection -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            limit = self.limits.max_connections
            self._refuse(
                503,
                f"too many open connections (max_connections={limit}); retry later",
                "ServiceUnavailableError",
            )
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_write_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(
                self.limits.send_timeout_s, self._write_expired
            )

    def resume_writing(self) -> None:
        self._stop_write_deadline()
        super().resume_writing()

    def _stop_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_expired(self) -> None:
        """The client took nothing of its response for send_timeout_s: close (no
        answer can reach it); the application sees a disconnect."""
        self._write_deadline = None
        log.debug(
            "%s:%s closed: it read nothing for send_timeout_s=%g s",
            *(self.client or ("?", 0)),
            self.limits.send_timeout_s,
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.abort()  # drop what is buffered: close() would wait to send it

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _TooManyHeaders):
                self._refuse(
                    431,
                    f"the request has more than max_header_count="
                    f"{self.limits.max_header_count} header lines",
                    "RequestHeaderFieldsTooLargeError",
                )
                return
            # Another callback failed on what the client sent (an invalid URL: uvicorn
            # parses it in on_headers_complete): the client's fault, not ours.
            self._refuse(400, "invalid HTTP request", "BadRequestError")
            return
        except httptools.HttpParserError:
            self._refuse(400, "invalid HTTP request", "BadRequestError")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(
                431,
                f"the request head is over max_header_bytes={self.limits.max_header_bytes}",
                "RequestHeaderFieldsTooLargeError",
            )

    # -- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            raise _TooManyHeaders
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body, self._head_bytes = False, True, 0
        super().on_headers_complete()
        self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._in_body, self._head_bytes = True, False, 0
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()


def guarded_protocol(limits: TransportLimits) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for ``limits``."""
    return type("GuardedHttpToolsProtocol", (_GuardedProtocol,), {"limits": limits})
