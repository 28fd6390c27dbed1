"""The asynchronous client :class:`AsyncClient` (its requests: :mod:`ipc.stream`; its
waiting calls: :mod:`ipc.waiters`; its socket: :mod:`ipc.dealer`). :mod:`ipc.client`
re-exports all of this module's ``__all__``; read its docstring for usage."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self, TypeVar

import msgspec
import zmq
import zmq.asyncio

from ipc.dealer import connect, curve_keys, send, send_nowait
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
    Health,
    HealthStatus,
    Inspect,
    InspectReply,
    Metrics,
    MetricsReply,
    Ping,
    Pong,
    ServerMessage,
    server_decoder,
)
from ipc.stream import (
    AsyncStream,
    ClientCompletion,
    Event,
    Failure,
    RepliesLostError,
    generate_message,
)
from ipc.waiters import (
    DEFAULT_TIMEOUT,
    ControlEntry,
    Timeout,
    check_seconds,
    check_timeout,
    discard,
    pop_entry,
    pop_oldest,
    pop_waiter,
)
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
    "RepliesLostError",
    "RequestRejectedError",
    "ServerError",
    "ServerUnavailableError",
    "ShuttingDownError",
    "UnknownRequestError",
    "WorkerLostError",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
ABORT_LINGER_MS = 500
"""How long a closed client's socket keeps trying to deliver the aborts of its calls
still in flight (the context's I/O thread sends them; close does not wait)."""


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
    :class:`~ipc.errors.ServerUnavailableError`, even one with ``timeout=None``. Silence
    is counted only while the client could listen: a stretch during which its event loop
    was blocked counts as at most ``ping_interval`` (the server had no ping to answer,
    and its frames wait in the socket), so a busy caller does not fail its own calls.
    The client asks the server to number its replies; a gap in the numbers (a reply
    lost on the way) fails every waiting call with :class:`RepliesLostError` rather than
    leaving one to wait for ever. The client stays usable afterwards. ``identity`` sets
    the socket's routing id (default: one chosen by ZeroMQ). The client binds to the
    event loop of its first call; use it from that loop only. ::

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
        self.timeout = check_timeout(timeout)
        self.ping_interval = check_seconds("ping_interval", ping_interval)
        self.server_timeout_s = check_seconds("server_timeout_s", server_timeout_s)
        if self.server_timeout_s <= self.ping_interval:
            raise ValueError(
                f"server_timeout_s ({server_timeout_s!r}) must be greater than "
                f"ping_interval ({ping_interval!r})"
            )
        self._identity = identity
        self._curve = curve_keys(curve_server_key, curve_public_key, curve_secret_key)
        self._context = context
        self._socket: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._requests: dict[str, asyncio.Queue[Event]] = {}
        self._work = asyncio.Event()
        """Set when a call starts waiting; wakes the pinger."""
        self._last_heard = 0.0
        """Loop time of the last frame from the server, or of the end of the last idle
        period (nothing waiting), whichever is later."""
        self._silent_s = 0.0
        """Time the client listened (calls waiting, its loop not blocked) since
        ``_last_heard``: what :meth:`_ping_loop` compares with ``server_timeout_s``."""
        self._next_number = 0
        """The number the server's next numbered reply must carry."""
        self._busy_period = 0
        """Counts idle -> waiting transitions; ``_numbered_period`` is the one in which
        the last numbered reply came (a restart of the numbers after an idle period is
        the server having forgotten an idle client, not a loss)."""
        self._numbered_period = 0
        self._instance = ""
        """The run of the server the last Pong came from ("" before the first)."""
        self._announce = False
        """The next call's frame goes after a ``Ping(sequenced=True)``: the server forgets
        a client idle past its ``client_timeout_s``, numbering included."""
        self._stuck_sends: set[asyncio.Future[None]] = set()
        """Sends waiting on a full socket; ``_fail_all`` makes them give up."""
        self._abort_waiters: dict[str, deque[asyncio.Future[AbortAck]]] = {}
        self._control_order = itertools.count()
        self._control_waiters: dict[type[Any], deque[ControlEntry]] = {
            HealthStatus: deque(),
            InspectReply: deque(),
            MetricsReply: deque(),
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
        user: str = "",
        **sampling_fields: Any,
    ) -> ClientCompletion:
        """Run one request to the end and return its :class:`ClientCompletion`.

        Exactly one of ``prompt`` (text) and ``prompt_token_ids`` (else ``ValueError``).
        ``request_id`` defaults to a fresh uuid4 hex. ``user`` names the end user a
        shared client sends it for (fair share and the per-user cap count per user;
        "" = this client). Sampling is either ``sampling`` or :class:`SamplingParams`
        fields as keywords::

            completion = await client.generate("2 + 2 =", max_tokens=4, temperature=0)
            completion = await client.generate(prompt_token_ids=[1, 15, 7], n=2, seed=1)
        """
        stream = AsyncStream(
            self,
            generate_message(
                prompt,
                prompt_token_ids,
                request_id,
                priority,
                sampling,
                sampling_fields,
                False,
                user,
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
        user: str = "",
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
            generate_message(
                prompt,
                prompt_token_ids,
                request_id,
                priority,
                sampling,
                sampling_fields,
                True,
                user,
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
            discard(waiters, future)
            if not waiters and self._abort_waiters.get(request_id) is waiters:
                del self._abort_waiters[request_id]
        return ack.aborted

    async def inspect(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> InspectReply:
        """The scheduler's state: queues, block usage, prefix cache, per-request states."""
        return await self._control(Inspect(), InspectReply, timeout, "inspect")

    async def health(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> HealthStatus:
        """``status`` is ``ok``, ``starting`` (no worker yet) or ``degraded``."""
        return await self._control(Health(), HealthStatus, timeout, "health")

    async def metrics(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> MetricsReply:
        """The server's gauges, token counters and latency histograms (every client's
        requests count)."""
        return await self._control(Metrics(), MetricsReply, timeout, "metrics")

    async def ping(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> float:
        """Round trip to the server in seconds (a liveness check)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self._control(Ping(sequenced=True), Pong, timeout, "ping")
        return loop.time() - start

    async def close(self) -> None:
        """Stop the background tasks and close the socket. Calls still waiting raise
        :class:`~ipc.errors.ClientClosedError`, and their requests are aborted on the
        server (the aborts get :data:`ABORT_LINGER_MS` to leave; a request whose abort
        is lost is reaped by the server after its ``client_timeout_s``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        on_own_loop = self._loop is asyncio.get_running_loop()
        if tasks and on_own_loop:
            await asyncio.gather(*tasks, return_exceptions=True)
        in_flight = list(self._requests) if on_own_loop else []
        for request_id in in_flight:
            self._send_nowait(Abort(request_id=request_id))
        if in_flight:
            await asyncio.sleep(0)  # the sends queue their frames
        self._fail_all(lambda: ClientClosedError("the client was closed"))
        if self._socket is not None:
            self._socket.close(linger=ABORT_LINGER_MS if in_flight else 0)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals -----------------------------------------------------------------------

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if timeout is DEFAULT_TIMEOUT else check_timeout(timeout)

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
        socket = connect(context, self.address, self._identity, self._curve)
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
        if self._announce:
            self._announce = False
            self._send_nowait(Ping(sequenced=True))
        await send(self._socket, message, self._stuck_sends)

    def _send_nowait(self, message: ClientMessage) -> None:
        """Best-effort send that never waits (pings, aborts of abandoned requests)."""
        send_nowait(self._socket, message)

    def _register(self, request_id: str) -> asyncio.Queue[Event]:
        if request_id in self._requests:
            raise BadRequestError(
                "duplicate", f"request id {request_id!r} is already in flight here", request_id
            )
        queue: asyncio.Queue[Event] = asyncio.Queue()
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
            self._silent_s = 0.0
            self._busy_period += 1
            self._announce = True
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

    def _forget(self, request_id: str, queue: asyncio.Queue[Event], *, abort: bool) -> None:
        """Stop routing replies to ``queue``; with ``abort``, ask the server to drop it."""
        if self._requests.get(request_id) is not queue:
            return  # already failed by close(), or the id was reused after this one
        del self._requests[request_id]
        if abort:
            self._send_nowait(Abort(request_id=request_id))

    def _forget_threadsafe(self, request_id: str, queue: asyncio.Queue[Event]) -> None:
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
            discard(waiters, entry)

    async def _receive_loop(self, socket: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await socket.recv_multipart()
                self._last_heard = asyncio.get_running_loop().time()  # any frame: alive
                self._silent_s = 0.0
                if len(frames) == 2:
                    self._check_number(frames[1])
                try:
                    message = server_decoder.decode(frames[0])
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

    def _check_number(self, frame: bytes) -> None:
        """The number of a reply: a gap, or numbers started afresh while the same calls
        waited, fails every waiting call (any of them may have lost its reply)."""
        number = int.from_bytes(frame, "big")
        expected, self._next_number = self._next_number, number + 1
        same_period = self._numbered_period == self._busy_period
        self._numbered_period = self._busy_period
        if number == expected:
            return
        if number == 0:
            if not same_period:
                return  # the server forgot this client while it was idle: nothing lost
            detail = "the server numbered its replies afresh (it restarted or took us as gone)"
        elif number > expected:
            detail = f"{number - expected} missing (got number {number}, expected {expected})"
        else:
            detail = f"reply number {number} came after {expected - 1}"
        self._lose_all(detail)

    def _lose_all(self, detail: str) -> None:
        """Fail every waiting call with :class:`RepliesLostError`; abort their requests."""
        logger.warning("replies from %s were lost: %s", self.address, detail)
        abandoned = list(self._requests)
        self._fail_all(functools.partial(RepliesLostError, self.address, detail))
        for request_id in abandoned:
            self._send_nowait(Abort(request_id=request_id))

    def _check_instance(self, instance: str) -> None:
        """A Pong from another run of the server than the last one: the requests still
        waiting died with the one before (it restarted within server_timeout_s)."""
        known, self._instance = self._instance, instance or self._instance
        if known and instance and instance != known and self._requests:
            self._lose_all("the server restarted: requests in flight died with it")

    def _dispatch(self, message: ServerMessage) -> None:
        if isinstance(message, Pong):
            self._check_instance(message.instance)
        if isinstance(message, DeltaBatch):
            for delta in message.deltas:
                self._to_request(delta.request_id, delta)
        elif isinstance(message, Accepted | Delta | Finished):
            self._to_request(message.request_id, message)
        elif isinstance(message, ErrorReply):
            self._dispatch_error(message)
        elif isinstance(message, AbortAck):
            if (future := pop_waiter(self._abort_waiters.get(message.request_id))) is not None:
                future.set_result(message)
        else:
            entry = pop_entry(self._control_waiters[type(message)])
            if entry is not None:
                entry[1].set_result(message)

    def _dispatch_error(self, reply: ErrorReply) -> None:
        """An ErrorReply goes to the request it names; one that names no request (the
        server could not attribute the frame) fails the oldest waiting control call;
        ``unknown_request`` answers an Abort first."""
        request_id = reply.request_id
        if request_id is None:
            oldest = pop_oldest(self._control_waiters)
            if oldest is None:
                logger.warning("error reply for no request from %s: %s", self.address, reply)
            else:
                oldest[1].set_exception(error_from_reply(reply))
            return
        abort_waiters = self._abort_waiters.get(request_id)
        abort_first = reply.code is ErrorCode.UNKNOWN_REQUEST or request_id not in self._requests
        if abort_first and (future := pop_waiter(abort_waiters)) is not None:
            future.set_exception(error_from_reply(reply))
        else:
            self._to_request(request_id, reply)

    def _to_request(self, request_id: str, event: Event) -> None:
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
        next_ping = looked = loop.time() + self.ping_interval
        while True:
            if not self._waiting():
                self._work.clear()
                await self._work.wait()
                next_ping = loop.time() + self.ping_interval
                looked = loop.time()
                continue
            now = loop.time()
            self._count_silence(now, looked)
            looked = now
            if self._silent_s >= self.server_timeout_s:
                # Frames may wait in the socket behind a blocked loop: let the receiver
                # take them before deciding.
                for _ in range(3):
                    await asyncio.sleep(0)
                if self._last_heard >= now:
                    continue
                silent_s = self._silent_s
                logger.warning("no answer from %s for %.1f s", self.address, silent_s)
                abandoned = list(self._requests)
                self._fail_all(functools.partial(ServerUnavailableError, self.address, silent_s))
                for request_id in abandoned:  # in case the server was only stalled
                    self._send_nowait(Abort(request_id=request_id))
                self._silent_s = 0.0
                continue
            if now >= next_ping:
                self._send_nowait(Ping(sequenced=True))
                next_ping = now + self.ping_interval
            await asyncio.sleep(
                max(0.0, min(next_ping - now, self.server_timeout_s - self._silent_s))
            )

    def _count_silence(self, now: float, looked: float) -> None:
        """Add the time since the pinger last looked (``looked``) to ``_silent_s``, at
        most ``ping_interval`` of it: the pinger looks at least that often unless the
        event loop was blocked, and time the loop was blocked proves nothing (no ping
        went out to be answered; what came waits in the socket)."""
        if self._last_heard > looked:  # heard since: count from the last frame
            self._silent_s = min(now - self._last_heard, self.ping_interval)
        else:
            self._silent_s += min(now - looked, self.ping_interval)

    def _fail_all(self, failure: Callable[[], Failure]) -> None:
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
