"""The asynchronous client: :class:`AsyncClient`, :class:`AsyncStream` and
:class:`ClientCompletion`. :mod:`ipc.client` re-exports all of it; read its docstring
for usage."""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import logging
import math
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, Self, TypeVar

import msgspec
import zmq
import zmq.asyncio

from ipc.errors import (
    BadRequestError,
    ClientClosedError,
    ClientTimeoutError,
    OverloadedError,
    RequestRejectedError,
    ServerError,
    ServerUnavailableError,
    ShuttingDownError,
    UnknownRequestError,
    WorkerLostError,
    error_from_reply,
)
from ipc.schema import (
    Abort,
    AbortAck,
    Accepted,
    ClientMessage,
    Delta,
    DeltaBatch,
    ErrorCode,
    ErrorReply,
    Finished,
    Generate,
    Health,
    HealthStatus,
    Inspect,
    InspectReply,
    Ping,
    Pong,
    ServerMessage,
    Timings,
    Usage,
    encode,
    server_decoder,
)
from shared.outputs import CompletionSample, FinishReason
from shared.sampling import SamplingParams

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "AsyncStream",
    "BadRequestError",
    "ClientClosedError",
    "ClientCompletion",
    "ClientTimeoutError",
    "OverloadedError",
    "RequestRejectedError",
    "ServerError",
    "ServerUnavailableError",
    "ShuttingDownError",
    "UnknownRequestError",
    "WorkerLostError",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class _Default(enum.Enum):
    TIMEOUT = "the client's timeout"


DEFAULT_TIMEOUT = _Default.TIMEOUT
"""Sentinel for a call's ``timeout``: use the client's own ``timeout``."""

Timeout = float | None | _Default
"""A call's timeout: seconds, ``None`` (wait forever) or :data:`DEFAULT_TIMEOUT`."""


class ClientCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request as the client sees it.

    The server's :class:`~shared.outputs.Completion` flattened, with what ``Finished``
    adds: ``token_ids``, ``text`` and ``finish_reason`` are those of sample 0 (the only
    one unless ``n > 1``); ``samples`` holds all of them.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    samples: list[CompletionSample]
    usage: Usage
    timings: Timings
    """``queue_s`` (arrival to first scheduled), ``ttft_s`` (to first token),
    ``total_s`` (to finish), all measured by the server."""

    @classmethod
    def from_finished(cls, finished: Finished) -> ClientCompletion:
        samples = sorted(finished.completion.samples, key=lambda sample: sample.index)
        first = samples[0] if samples else None
        return cls(
            request_id=finished.request_id,
            prompt_token_ids=finished.completion.prompt_token_ids,
            token_ids=first.token_ids if first else [],
            text=first.text if first else "",
            finish_reason=first.finish_reason if first else FinishReason.ABORT,
            samples=samples,
            usage=finished.usage,
            timings=finished.timings,
        )


_Failure = ClientClosedError | ServerUnavailableError
"""What fails every waiting call at once (see ``AsyncClient._fail_all``)."""

_Event = Accepted | Delta | Finished | ErrorReply | _Failure
"""What the receiver (or ``_fail_all``) hands a request's queue."""

_ControlEntry = tuple[int, "asyncio.Future[Any]"]
"""A waiting inspect/health/ping call: (send order, future of its reply)."""


class _StreamState(enum.Enum):
    NEW = "new"  # not sent yet
    OPEN = "open"  # registered with the client and sent
    DONE = "done"  # finished, failed, timed out or closed


class AsyncStream:
    """The Delta events of one streaming request: ``async for delta in stream``.

    Made by :meth:`AsyncClient.stream`; the request is sent on the first iteration (or
    on ``async with``). Iteration ends cleanly after the server's ``Finished``, whose
    :class:`ClientCompletion` is then :attr:`completion`; an ``ErrorReply`` raises the
    matching :class:`~ipc.errors.ServerError`, the deadline
    :class:`~ipc.errors.ClientTimeoutError`, and a server silent for the client's
    ``server_timeout_s`` :class:`~ipc.errors.ServerUnavailableError` (the request is
    then aborted on the server without waiting, in case it was only stalled).
    ``timeout`` bounds the whole request, from sending to ``Finished``.

    Leaving early (``break``, an exception, :meth:`aclose`, or dropping the object)
    aborts the request on the server, best effort. ``async with`` makes that explicit::

        async with client.stream("Hi", max_tokens=100) as stream:
            async for delta in stream:
                if "." in delta.text:
                    break  # the request is aborted on exit
    """

    def __init__(
        self,
        client: AsyncClient,
        request: Generate,
        timeout: float | None,
        operation: str = "stream",
    ) -> None:
        self._client = client
        self._request = request
        self._timeout = timeout
        self._operation = operation
        self._state = _StreamState.NEW
        self._queue: asyncio.Queue[_Event] | None = None
        self._deadline: float | None = None
        self.request_id: str = request.request_id
        self.prompt_token_ids: list[int] | None = None
        """The prompt as the server tokenized it, once ``Accepted`` arrived."""
        self.completion: ClientCompletion | None = None
        """The result, once iteration ended with ``Finished``."""

    @property
    def done(self) -> bool:
        return self._state is _StreamState.DONE

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Delta:
        delta = await self._next_or_none()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def __aenter__(self) -> Self:
        await self._guarded(self._open())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: a request still running is aborted on the server (without waiting)."""
        self._finish(abort=self._state is _StreamState.OPEN)

    async def _next_or_none(self) -> Delta | None:
        """The next Delta, or None once the request finished."""
        if self._state is _StreamState.DONE:
            return None
        return await self._guarded(self._next_delta())

    async def _guarded(self, step: Coroutine[Any, Any, _T]) -> _T:
        """Run ``step``; on a timeout, a cancellation or any failure, leave the stream
        done and abort the request on the server if it was sent."""
        try:
            return await step
        except TimeoutError:
            self._finish(abort=True)
            if self._timeout is None:
                raise
            raise ClientTimeoutError(self.request_id, self._timeout, self._operation) from None
        except BaseException:
            self._finish(abort=True)
            raise

    async def _open(self) -> None:
        if self._state is not _StreamState.NEW:
            return
        client = self._client
        client._ensure_started()
        self._queue = client._register(self.request_id)
        self._state = _StreamState.OPEN
        if self._timeout is not None:
            self._deadline = asyncio.get_running_loop().time() + self._timeout
        async with asyncio.timeout_at(self._deadline):
            await client._send(self._request)

    async def _next_delta(self) -> Delta | None:
        await self._open()
        while True:
            event = await self._next_event()
            if isinstance(event, Delta):
                return event
            if isinstance(event, Accepted):
                self.prompt_token_ids = event.prompt_token_ids
                continue
            self._finish(abort=False)
            if isinstance(event, Finished):
                self.completion = ClientCompletion.from_finished(event)
                return None
            if isinstance(event, ErrorReply):
                raise error_from_reply(event)
            raise event

    async def _next_event(self) -> _Event:
        queue = self._queue
        assert queue is not None
        if not queue.empty():  # whatever already arrived wins over the deadline
            return queue.get_nowait()
        async with asyncio.timeout_at(self._deadline):
            return await queue.get()

    def _finish(self, *, abort: bool) -> None:
        if self._state is _StreamState.OPEN:
            assert self._queue is not None
            self._client._forget(self.request_id, self._queue, abort=abort)
        self._state = _StreamState.DONE

    def __del__(self) -> None:
        if getattr(self, "_state", None) is _StreamState.OPEN and self._queue is not None:
            self._client._forget_threadsafe(self.request_id, self._queue)


class AsyncClient:
    """Asynchronous client of the scheduler frontend (an ``async with`` context manager).

    ``timeout`` (seconds, ``None`` = forever) is the default for every call: for
    :meth:`generate` and :meth:`stream` it bounds the whole request, for the other calls
    the wait for their reply.

    While any call is waiting (a request, an abort, inspect/health/ping) the client
    sends ``Ping`` every ``ping_interval`` seconds, which must stay well below the
    server's ``client_timeout_s``. Every frame from the server is a sign of life; when
    none came for ``server_timeout_s`` seconds (counted only while calls wait; it must
    exceed ``ping_interval``) every waiting call raises
    :class:`~ipc.errors.ServerUnavailableError`, even one with ``timeout=None``. The
    client stays usable afterwards. ``identity`` sets the socket's routing id (default:
    one chosen by ZeroMQ). The client binds to the event loop of its first call; use it
    from that loop only. ::

        async with AsyncClient("ipc:///run/expeditor/frontend.sock", timeout=30) as client:
            results = await asyncio.gather(
                *(client.generate(p, max_tokens=32, temperature=0) for p in prompts)
            )
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
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self.timeout = _check_timeout(timeout)
        self.ping_interval = _check_seconds("ping_interval", ping_interval)
        self.server_timeout_s = _check_seconds("server_timeout_s", server_timeout_s)
        if self.server_timeout_s <= self.ping_interval:
            raise ValueError(
                f"server_timeout_s ({server_timeout_s!r}) must be greater than "
                f"ping_interval ({ping_interval!r})"
            )
        self._identity = identity
        self._curve = _curve_keys(curve_server_key, curve_public_key, curve_secret_key)
        self._context = context
        self._socket: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._requests: dict[str, asyncio.Queue[_Event]] = {}
        self._work = asyncio.Event()
        """Set when a call starts waiting; wakes the pinger."""
        self._last_heard = 0.0
        """Loop time of the last frame from the server, or of the end of the last idle
        period (nothing waiting), whichever is later."""
        self._stuck_sends: set[asyncio.Future[None]] = set()
        """Sends waiting on a full socket; ``_fail_all`` makes them give up."""
        self._abort_waiters: dict[str, deque[asyncio.Future[AbortAck]]] = {}
        self._control_order = itertools.count()
        self._control_waiters: dict[type[Any], deque[_ControlEntry]] = {
            HealthStatus: deque(),
            InspectReply: deque(),
            Pong: deque(),
        }

    # -- public API --------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._ensure_started()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: Timeout = DEFAULT_TIMEOUT,
        sampling: SamplingParams | None = None,
        **sampling_fields: Any,
    ) -> ClientCompletion:
        """Run one request to the end and return its :class:`ClientCompletion`.

        Exactly one of ``prompt`` (text) and ``prompt_token_ids`` (else ``ValueError``).
        ``request_id`` defaults to a fresh uuid4 hex. Sampling is either ``sampling``
        or :class:`SamplingParams` fields as keywords::

            completion = await client.generate("2 + 2 =", max_tokens=4, temperature=0)
            completion = await client.generate(prompt_token_ids=[1, 15, 7], n=2, seed=1)
        """
        stream = AsyncStream(
            self,
            _generate_message(
                prompt, prompt_token_ids, request_id, priority, sampling, sampling_fields, False
            ),
            self._timeout(timeout),
            operation="generate",
        )
        async for _ in stream:  # a non-streaming request gets no Deltas; ignore stray ones
            pass
        assert stream.completion is not None
        return stream.completion

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: Timeout = DEFAULT_TIMEOUT,
        sampling: SamplingParams | None = None,
        **sampling_fields: Any,
    ) -> AsyncStream:
        """Start a streaming request: same arguments as :meth:`generate`; returns an
        :class:`AsyncStream` of Delta events (arguments are checked here, the request
        is sent on the first iteration)::

            stream = client.stream("Tell me a story", max_tokens=200)
            async for delta in stream:
                print(delta.index, delta.text)
            print(stream.completion.finish_reason)
        """
        return AsyncStream(
            self,
            _generate_message(
                prompt, prompt_token_ids, request_id, priority, sampling, sampling_fields, True
            ),
            self._timeout(timeout),
        )

    async def abort(self, request_id: str, *, timeout: Timeout = DEFAULT_TIMEOUT) -> bool:
        """Abort a request by id; True if it was aborted, False if it had already
        finished. An id the server does not know raises
        :class:`~ipc.errors.UnknownRequestError`. The request's own waiter then ends
        with finish_reason ``abort``."""
        self._ensure_started()
        seconds = self._timeout(timeout)
        future: asyncio.Future[AbortAck] = asyncio.get_running_loop().create_future()
        self._start_waiting()
        waiters = self._abort_waiters.setdefault(request_id, deque())
        waiters.append(future)
        try:
            async with asyncio.timeout(seconds):
                await self._send(Abort(request_id=request_id))
                ack = await future
        except TimeoutError:
            assert seconds is not None
            raise ClientTimeoutError(request_id, seconds, "abort") from None
        finally:
            _discard(waiters, future)
            if not waiters and self._abort_waiters.get(request_id) is waiters:
                del self._abort_waiters[request_id]
        return ack.aborted

    async def inspect(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> InspectReply:
        """The scheduler's state: queues, block usage, prefix cache, per-request states."""
        return await self._control(Inspect(), InspectReply, timeout, "inspect")

    async def health(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> HealthStatus:
        """``status`` is ``ok``, ``starting`` (no worker yet) or ``degraded``."""
        return await self._control(Health(), HealthStatus, timeout, "health")

    async def ping(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> float:
        """Round trip to the server in seconds (a liveness check)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self._control(Ping(), Pong, timeout, "ping")
        return loop.time() - start

    async def close(self) -> None:
        """Stop the background tasks and close the socket (LINGER 0). Calls still
        waiting raise :class:`~ipc.errors.ClientClosedError`; requests still running on
        the server are reaped by it after its ``client_timeout_s``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks and self._loop is asyncio.get_running_loop():
            await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all(lambda: ClientClosedError("the client was closed"))
        if self._socket is not None:
            self._socket.close(linger=0)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals -----------------------------------------------------------------------

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if timeout is DEFAULT_TIMEOUT else _check_timeout(timeout)

    def _ensure_started(self) -> None:
        """Create and connect the socket and start the receiver and pinger, once."""
        if self._closed:
            raise ClientClosedError("the client is closed")
        loop = asyncio.get_running_loop()
        if self._socket is not None:
            if loop is not self._loop:
                raise RuntimeError("AsyncClient used from another event loop than its first")
            return
        context = self._context or zmq.asyncio.Context.instance()
        socket = context.socket(zmq.DEALER)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            if self._identity is not None:
                socket.setsockopt(zmq.ROUTING_ID, self._identity)
            if self._curve is not None:
                server_key, public_key, secret_key = self._curve
                socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)
                socket.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
                socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
            socket.connect(self.address)
        except BaseException:
            socket.close(linger=0)
            raise
        self._socket = socket
        self._loop = loop
        self._last_heard = loop.time()
        self._tasks = [
            loop.create_task(self._receive_loop(socket), name="expeditor-client-receiver"),
            loop.create_task(self._ping_loop(), name="expeditor-client-pinger"),
        ]

    async def _send(self, message: ClientMessage) -> None:
        """Send one frame. A send held up by a full socket (the server has read nothing
        for long) gives up, the frame unsent, when :meth:`_fail_all` runs: the caller's
        call has failed then, which it finds out next."""
        assert self._socket is not None
        sent = self._socket.send(encode(message))
        if not sent.done():
            given_up = asyncio.get_running_loop().create_future()
            self._stuck_sends.add(given_up)
            try:
                await asyncio.wait((sent, given_up), return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._stuck_sends.discard(given_up)
                if not sent.done():
                    sent.cancel()
        if not sent.cancelled():
            sent.result()

    def _send_nowait(self, message: ClientMessage) -> None:
        """Best-effort send that never waits (pings, aborts of abandoned requests)."""
        if self._socket is None or self._socket.closed:
            return
        sent = asyncio.ensure_future(self._socket.send(encode(message), zmq.NOBLOCK))
        sent.add_done_callback(_log_send_failure)

    def _register(self, request_id: str) -> asyncio.Queue[_Event]:
        if request_id in self._requests:
            raise BadRequestError(
                "duplicate", f"request id {request_id!r} is already in flight here", request_id
            )
        queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._start_waiting()
        self._requests[request_id] = queue
        return queue

    def _start_waiting(self) -> None:
        """Note that a call is about to wait for the server (call it before registering
        the call). After an idle period the silence clock restarts: time with nothing
        waiting is no sign of a dead server."""
        assert self._loop is not None
        if not self._waiting():
            self._last_heard = self._loop.time()
        self._work.set()

    def _waiting(self) -> bool:
        """Whether any call waits for the server: a request, an abort, a control call."""
        return bool(self._requests) or any(not future.done() for future in self._futures())

    def _futures(self) -> Iterator[asyncio.Future[Any]]:
        """The futures of abort and control calls (done ones included)."""
        for abort_waiters in self._abort_waiters.values():
            yield from abort_waiters
        for control_waiters in self._control_waiters.values():
            yield from (future for _, future in control_waiters)

    def _forget(self, request_id: str, queue: asyncio.Queue[_Event], *, abort: bool) -> None:
        """Stop routing replies to ``queue``; with ``abort``, ask the server to drop it."""
        if self._requests.get(request_id) is not queue:
            return  # already failed by close(), or the id was reused after this one
        del self._requests[request_id]
        if abort:
            self._send_nowait(Abort(request_id=request_id))

    def _forget_threadsafe(self, request_id: str, queue: asyncio.Queue[_Event]) -> None:
        """Abandon a request from any thread (a stream dropped unfinished)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(lambda: self._forget(request_id, queue, abort=True))
        except RuntimeError:  # the loop closed meanwhile
            pass

    async def _control(
        self, message: ClientMessage, reply_type: type[_T], timeout: Timeout, operation: str
    ) -> _T:
        """Send a request-less message and wait for its reply (answered in send order)."""
        self._ensure_started()
        seconds = self._timeout(timeout)
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        entry = (next(self._control_order), future)
        self._start_waiting()
        waiters = self._control_waiters[reply_type]
        waiters.append(entry)
        try:
            async with asyncio.timeout(seconds):
                await self._send(message)
                return await future
        except TimeoutError:
            assert seconds is not None
            raise ClientTimeoutError(None, seconds, operation) from None
        finally:
            _discard(waiters, entry)

    async def _receive_loop(self, socket: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await socket.recv_multipart()
                self._last_heard = asyncio.get_running_loop().time()  # any frame: alive
                try:
                    message = server_decoder.decode(frames[-1])
                except (msgspec.DecodeError, msgspec.ValidationError) as error:
                    logger.warning("dropping a frame from %s: %s", self.address, error)
                    continue
                self._dispatch(message)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if self._closed:
                return
            logger.exception("receiving from %s failed", self.address)
            self._closed = True
            reason = f"receiving from the server failed: {error!r}"
            self._fail_all(lambda: ClientClosedError(reason))
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            socket.close(linger=0)

    def _dispatch(self, message: ServerMessage) -> None:
        if isinstance(message, DeltaBatch):
            for delta in message.deltas:
                self._to_request(delta.request_id, delta)
        elif isinstance(message, Accepted | Delta | Finished):
            self._to_request(message.request_id, message)
        elif isinstance(message, ErrorReply):
            self._dispatch_error(message)
        elif isinstance(message, AbortAck):
            if (future := _pop_waiter(self._abort_waiters.get(message.request_id))) is not None:
                future.set_result(message)
        else:
            entry = _pop_entry(self._control_waiters[type(message)])
            if entry is not None:
                entry[1].set_result(message)

    def _dispatch_error(self, reply: ErrorReply) -> None:
        """An ErrorReply goes to the request it names; one that names no request (the
        server could not attribute the frame) fails the oldest waiting control call;
        ``unknown_request`` answers an Abort first."""
        request_id = reply.request_id
        if request_id is None:
            oldest: _ControlEntry | None = None
            for waiters in self._control_waiters.values():
                head = _head(waiters)
                if head is not None and (oldest is None or head[0] < oldest[0]):
                    oldest = head
            if oldest is None:
                logger.warning("error reply for no request from %s: %s", self.address, reply)
            else:
                _drop_head(self._control_waiters, oldest)
                oldest[1].set_exception(error_from_reply(reply))
            return
        abort_waiters = self._abort_waiters.get(request_id)
        abort_first = reply.code is ErrorCode.UNKNOWN_REQUEST or request_id not in self._requests
        if abort_first and (future := _pop_waiter(abort_waiters)) is not None:
            future.set_exception(error_from_reply(reply))
        else:
            self._to_request(request_id, reply)

    def _to_request(self, request_id: str, event: _Event) -> None:
        queue = self._requests.get(request_id)
        if queue is None:
            logger.debug("dropping %s for request %r, no longer waited for", event, request_id)
        else:
            queue.put_nowait(event)

    async def _ping_loop(self) -> None:
        """While any call waits, send ``Ping`` every ``ping_interval``; once nothing was
        heard from the server for ``server_timeout_s``, fail every waiting call with
        :class:`~ipc.errors.ServerUnavailableError` and abort its requests (best effort,
        never waiting: the frames wait in the socket for a server that comes back).
        Sleeps while nothing waits."""
        loop = asyncio.get_running_loop()
        next_ping = loop.time() + self.ping_interval
        while True:
            if not self._waiting():
                self._work.clear()
                await self._work.wait()
                next_ping = loop.time() + self.ping_interval
                continue
            now = loop.time()
            silent_s = now - self._last_heard
            if silent_s >= self.server_timeout_s:
                logger.warning("no answer from %s for %.1f s", self.address, silent_s)
                abandoned = list(self._requests)
                self._fail_all(functools.partial(ServerUnavailableError, self.address, silent_s))
                for request_id in abandoned:  # in case the server was only stalled
                    self._send_nowait(Abort(request_id=request_id))
                continue
            if now >= next_ping:
                self._send_nowait(Ping())
                next_ping = now + self.ping_interval
            await asyncio.sleep(min(next_ping, self._last_heard + self.server_timeout_s) - now)

    def _fail_all(self, failure: Callable[[], _Failure]) -> None:
        """Fail every waiting call, each with its own ``failure()``."""
        requests, self._requests = self._requests, {}
        for queue in requests.values():
            queue.put_nowait(failure())
        for future in list(self._futures()):
            if not future.done():
                future.set_exception(failure())
        for given_up in self._stuck_sends:
            if not given_up.done():
                given_up.set_result(None)


def _generate_message(
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    request_id: str | None,
    priority: int,
    sampling: SamplingParams | None,
    sampling_fields: dict[str, Any],
    stream: bool,
) -> Generate:
    """Check the arguments of generate/stream and build the Generate frame."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompt and prompt_token_ids")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt: expected a string, got {type(prompt).__name__}")
    if prompt_token_ids is not None:
        prompt_token_ids = list(prompt_token_ids)
        if not all(type(token) is int for token in prompt_token_ids):
            raise ValueError("prompt_token_ids: expected a list of integers")
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id: expected a non-empty string, got {request_id!r}")
    if type(priority) is not int:
        raise ValueError(f"priority: expected an integer, got {priority!r}")
    if sampling is None:
        sampling = SamplingParams.from_dict(sampling_fields)
    elif sampling_fields:
        raise ValueError("give either sampling or SamplingParams fields as keywords, not both")
    return Generate(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        priority=priority,
        stream=stream,
    )


def _check_seconds(name: str, value: float) -> float:
    """``value`` as float seconds: a positive finite number, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name}: must be a positive finite number, got {value!r}")
    return float(value)


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout: must be a positive number or None, got {timeout!r}")
    return float(timeout)


def _curve_keys(
    server_key: bytes | None, public_key: bytes | None, secret_key: bytes | None
) -> tuple[bytes, bytes, bytes] | None:
    if server_key is None:
        if public_key is not None or secret_key is not None:
            raise ValueError("curve_public_key/curve_secret_key need curve_server_key")
        return None
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    if (public_key is None) != (secret_key is None):
        raise ValueError("give both curve_public_key and curve_secret_key, or neither")
    if public_key is None or secret_key is None:
        public_key, secret_key = zmq.curve_keypair()
    for name, key in (("server", server_key), ("public", public_key), ("secret", secret_key)):
        if not isinstance(key, bytes) or len(key) not in (32, 40):
            raise ValueError(f"curve_{name}_key: expected 40 bytes of Z85 or 32 raw bytes")
    return server_key, public_key, secret_key


def _log_send_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and (error := future.exception()) is not None:
        logger.debug("best-effort send failed: %r", error)


def _head(
    waiters: deque[_ControlEntry],
) -> _ControlEntry | None:
    """The oldest waiter still waiting (done ones are dropped on the way)."""
    while waiters and waiters[0][1].done():
        waiters.popleft()
    return waiters[0] if waiters else None


def _pop_entry(
    waiters: deque[_ControlEntry],
) -> _ControlEntry | None:
    entry = _head(waiters)
    if entry is not None:
        waiters.popleft()
    return entry


def _drop_head(
    all_waiters: dict[type[Any], deque[_ControlEntry]],
    entry: _ControlEntry,
) -> None:
    for waiters in all_waiters.values():
        if waiters and waiters[0] is entry:
            waiters.popleft()
            return


def _pop_waiter(waiters: deque[asyncio.Future[_T]] | None) -> asyncio.Future[_T] | None:
    while waiters:
        future = waiters.popleft()
        if not future.done():
            return future
    return None


def _discard(waiters: deque[Any], item: object) -> None:
    try:
        waiters.remove(item)
    except ValueError:
        pass
