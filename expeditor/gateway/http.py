"""HTTP plumbing of the gateway that is not OpenAI-specific: reading a bounded body,
the API key check, watching for a client that goes away, and the server-sent-events
response that stops (and so aborts the request) the moment its client disconnects."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from expeditor.gateway.protocol import GatewayRequestError

__all__ = [
    "STOPPING_EVENT",
    "ClientGone",
    "EventStreamResponse",
    "RawSend",
    "Stopped",
    "check_api_key",
    "read_body",
    "unless_gone",
]

RAW_SEND = "expeditor.raw_send"
"""Scope key of the server's own ``send`` (see :class:`RawSend`)."""


class RawSend:
    """Outermost ASGI wrapper: keeps the server's ``send`` in the scope, so that an event
    stream sends its chunks past the framework's per-message wrappers (they only watch
    for the response start, which still goes through them). A long stream sends one
    message per token; this is where its time went."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


_T = TypeVar("_T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class Stopped(Exception):
    """The gateway stopped before the answer was ready."""


STOPPING_EVENT = (
    b'data: {"error": {"message": "the gateway is shutting down", '
    b'"type": "ServiceUnavailableError", "param": null, "code": 503}}\n\n'
)
"""The event that ends a stream cut short by the gateway's stop (before ``[DONE]``)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; 413 when it is (or says it will be) larger than ``limit``.
    A body that does not arrive within ``body_timeout_s`` ends with the connection
    (closed by :mod:`expeditor.gateway.transport`): a 400 nobody receives, not an
    error logged as the gateway's."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise GatewayRequestError(
            "the connection closed before the whole body arrived", kind="ClientDisconnected"
        ) from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> GatewayRequestError:
    return GatewayRequestError(
        f"the body is {size}+ bytes; this server takes at most max_body_bytes={limit}",
        status=413,
        kind="RequestTooLargeError",
    )


def check_api_key(request: Request, key: bytes | None) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` (compared in
    constant time); nothing to check when no key is set."""
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not hmac.compare_digest(given, key):
        raise GatewayRequestError(
            "missing or wrong API key: send Authorization: Bearer <key>",
            status=401,
            kind="AuthenticationError",
        )


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(
    request: Request, work: Awaitable[_T], stop: asyncio.Event | None = None
) -> _T:
    """Run ``work`` (a coroutine) unless the client disconnects first (or ``stop`` is
    set): then cancel it (which aborts its scheduler requests) and raise
    :class:`ClientGone` (or :class:`Stopped`). Call after the body was read."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(_until_disconnect(request.receive))]
    if stop is not None:
        watchers.append(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait((task, *watchers), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if stop is not None and stop.is_set():
        raise Stopped
    raise ClientGone


class EventStreamResponse(Response):
    """A ``text/event-stream`` response from an async iterator of ready-made event
    bytes. The iterator is closed (its ``finally`` blocks run: requests are aborted) as
    soon as the client disconnects, even while nothing is being sent."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        first: bytes = b"",
        stop: asyncio.Event | None = None,
        done: Callable[[], None] | None = None,
    ) -> None:
        """``first``: an event already taken from ``events``, sent before the rest.
        ``stop``: when set, the stream ends at once with an error event and ``[DONE]``
        (the gateway stops). ``done``: called once the response is over, however."""
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events = events
        self.first = first
        self.stop = stop
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        raw_send = scope.get(RAW_SEND, send)
        pump = asyncio.ensure_future(self._pump(raw_send))
        watchers = [asyncio.ensure_future(_until_disconnect(receive))]
        if self.stop is not None:
            watchers.append(asyncio.ensure_future(self.stop.wait()))
        try:
            await asyncio.wait((pump, *watchers), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for watcher in watchers:
                watcher.cancel()
            if not pump.done():
                pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            aclose: Any = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.done is not None:
                self.done()
        if pump.cancelled() and self.stop is not None and self.stop.is_set():
            for event in (STOPPING_EVENT, b"data: [DONE]\n\n", b""):
                message = {"type": "http.response.body", "body": event, "more_body": bool(event)}
                await raw_send(message)
            return
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()  # type: ignore[misc]  # checked just above

    async def _pump(self, send: Send) -> None:
        message: dict[str, Any] = {"type": "http.response.body", "body": b"", "more_body": True}
        if self.first:
            message["body"] = self.first
            await send(message)
        async for event in self.events:
            message["body"] = event  # the server copies the bytes out before returning
            await send(message)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
