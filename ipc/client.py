"""Client library for the scheduler's ZeroMQ frontend: :class:`AsyncClient` and :class:`Client`.

Both speak the client half of :mod:`ipc.schema` over one DEALER socket connected to the
scheduler's ROUTER. Every frame is a single msgpack-encoded message. Many requests run
concurrently on one client: a background receiver routes each reply by request id, and
a background pinger sends ``Ping`` every ``ping_interval`` seconds while any call is
waiting (a request, an abort, inspect/health/ping). Liveness is checked both ways: a
client silent for the server's ``client_timeout_s`` is taken as gone and its requests
are aborted, and a server from which nothing (not even a ``Pong``) came for the client's
``server_timeout_s`` while calls waited is taken as gone: every waiting call raises
:class:`~ipc.errors.ServerUnavailableError`, whatever its own timeout. The client stays
usable; ZeroMQ reconnects by itself when the server is back.

Asynchronous use::

    async with AsyncClient("ipc:///run/expeditor/frontend.sock") as client:
        completion = await client.generate("The capital of France is", max_tokens=8)
        print(completion.text, completion.finish_reason, completion.usage)

        stream = client.stream("Once upon a time", max_tokens=64, temperature=0.8)
        async for delta in stream:
            print(delta.text, end="", flush=True)
        print(stream.completion.timings)

Synchronous use (the same calls; a private event loop runs in a background thread)::

    with Client("ipc:///run/expeditor/frontend.sock") as client:
        print(client.health().status)
        for delta in client.stream(prompt_token_ids=[1, 2, 3], max_tokens=16):
            print(delta.token_ids)

Keyword arguments of :meth:`AsyncClient.generate` / :meth:`AsyncClient.stream` beyond
the listed ones are :class:`~shared.sampling.SamplingParams` fields; they are validated
before anything is sent (bad ones raise :class:`~shared.errors.InvalidRequestError`).
Server refusals raise :class:`~ipc.errors.ServerError` subclasses, client-side timeouts
raise :class:`~ipc.errors.ClientTimeoutError`; a timed-out (or cancelled, or abandoned)
request is aborted on the server, best effort.

The default endpoints are ``ipc://`` sockets or 127.0.0.1. Anything beyond loopback
needs CURVE: pass the server's public key as ``curve_server_key`` (Z85 text, 40 bytes,
or raw, 32 bytes) and optionally this client's own key pair (an ephemeral one is made
otherwise).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, Self, TypeVar

from ipc.async_client import (
    DEFAULT_TIMEOUT,
    AsyncClient,
    AsyncStream,
    ClientCompletion,
    RepliesLostError,
    Timeout,
)
from ipc.errors import (
    BadRequestError,
    ClientClosedError,
    ClientTimeoutError,
    InternalServerError,
    OverloadedError,
    QuarantinedError,
    RequestRejectedError,
    ServerError,
    ServerUnavailableError,
    ShuttingDownError,
    UnknownRequestError,
    WorkerLostError,
)
from ipc.schema import Delta, HealthStatus, InspectReply, MetricsReply
from shared.sampling import SamplingParams

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "AsyncStream",
    "BadRequestError",
    "Client",
    "ClientClosedError",
    "ClientCompletion",
    "ClientTimeoutError",
    "InternalServerError",
    "OverloadedError",
    "QuarantinedError",
    "RepliesLostError",
    "RequestRejectedError",
    "ServerError",
    "ServerUnavailableError",
    "ShuttingDownError",
    "Stream",
    "UnknownRequestError",
    "WorkerLostError",
]

_T = TypeVar("_T")


class Stream:
    """The synchronous :class:`AsyncStream`: a plain iterator of Delta events.

    ::

        with client.stream("Hello", max_tokens=32) as stream:
            for delta in stream:
                print(delta.text, end="")
        print(stream.completion.usage)
    """

    def __init__(self, client: Client, stream: AsyncStream) -> None:
        self._client = client
        self._stream = stream
        self.request_id = stream.request_id

    @property
    def completion(self) -> ClientCompletion | None:
        """The result, once iteration ended."""
        return self._stream.completion

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self._stream.prompt_token_ids

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        delta = self._client._call(self._stream._next_or_none())
        if delta is None:
            raise StopIteration
        return delta

    def close(self) -> None:
        """Stop: a request still running is aborted on the server (without waiting)."""
        if not self._stream.done and not self._client.closed:
            self._client._call(self._stream.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class Client:
    """Synchronous client (a ``with`` context manager) with the API of :class:`AsyncClient`.

    It runs a private event loop in a daemon thread and delegates every call to an
    :class:`AsyncClient` there (the arguments are its own), so pings and the check on
    the server's liveness continue while a call blocks and the semantics are the same.
    Calls may come from any thread; Ctrl-C during a call cancels it (and aborts its
    request on the server). ::

        with Client("ipc:///run/expeditor/frontend.sock") as client:
            completion = client.generate("Hello", max_tokens=16, temperature=0)
            print(completion.text)
            print(client.inspect().snapshot)
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 60.0,
        ping_interval: float = 1.0,
        server_timeout_s: float = 5.0,
        identity: bytes | None = None,
        curve_server_key: bytes | None = None,
        curve_public_key: bytes | None = None,
        curve_secret_key: bytes | None = None,
    ) -> None:
        self._async = AsyncClient(
            address,
            timeout=timeout,
            ping_interval=ping_interval,
            server_timeout_s=server_timeout_s,
            identity=identity,
            curve_server_key=curve_server_key,
            curve_public_key=curve_public_key,
            curve_secret_key=curve_secret_key,
        )
        self.address = address
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="expeditor-client", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._async.__aenter__())
        except BaseException:
            self.close()
            raise

    @property
    def timeout(self) -> float | None:
        return self._async.timeout

    @property
    def closed(self) -> bool:
        return self._closed

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: Timeout = DEFAULT_TIMEOUT,
        sampling: SamplingParams | None = None,
        user: str = "",
        **sampling_fields: Any,
    ) -> ClientCompletion:
        """See :meth:`AsyncClient.generate`."""
        return self._call(
            self._async.generate(
                prompt,
                prompt_token_ids=prompt_token_ids,
                request_id=request_id,
                priority=priority,
                timeout=timeout,
                sampling=sampling,
                user=user,
                **sampling_fields,
            )
        )

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: Timeout = DEFAULT_TIMEOUT,
        sampling: SamplingParams | None = None,
        user: str = "",
        **sampling_fields: Any,
    ) -> Stream:
        """See :meth:`AsyncClient.stream`; returns a plain iterator of Delta events."""
        if self._closed:
            raise ClientClosedError("the client is closed")
        stream = self._async.stream(
            prompt,
            prompt_token_ids=prompt_token_ids,
            request_id=request_id,
            priority=priority,
            timeout=timeout,
            sampling=sampling,
            user=user,
            **sampling_fields,
        )
        return Stream(self, stream)

    def abort(self, request_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> bool:
        """See :meth:`AsyncClient.abort`."""
        return self._call(self._async.abort(request_id, timeout=timeout))

    def inspect(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> InspectReply:
        """See :meth:`AsyncClient.inspect`."""
        return self._call(self._async.inspect(timeout=timeout))

    def health(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> HealthStatus:
        """See :meth:`AsyncClient.health`."""
        return self._call(self._async.health(timeout=timeout))

    def metrics(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> MetricsReply:
        """See :meth:`AsyncClient.metrics`."""
        return self._call(self._async.metrics(timeout=timeout))

    def ping(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> float:
        """See :meth:`AsyncClient.ping`."""
        return self._call(self._async.ping(timeout=timeout))

    def close(self) -> None:
        """Close the client and stop its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self._async.close(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join()
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if self._closed:
            coroutine.close()
            raise ClientClosedError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop (and abort) the call
            raise


# -- helpers ---------------------------------------------------------------------------------
