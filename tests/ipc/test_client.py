"""ipc.client against a scripted fake frontend (a ROUTER socket in a thread)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import pickle
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zmq
import zmq.asyncio
from support.blocking import in_thread
from support.limits import SAFETY_S

from ipc.client import AsyncClient, Client, ClientCompletion
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
    error_from_reply,
)
from ipc.schema import (
    Abort,
    AbortAck,
    Accepted,
    ClientMessage,
    Delta,
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
    client_decoder,
    encode,
)
from shared.errors import InvalidRequestError
from shared.outputs import Completion as WireCompletion
from shared.outputs import CompletionSample

Replies = list[tuple[float, ServerMessage]]
"""What the fake server answers to one frame: (delay in seconds, message) pairs."""
Handler = Callable[[ClientMessage], Replies]
M = TypeVar("M")
T = TypeVar("T")


def prompt_ids(request: Generate) -> list[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    assert request.prompt is not None
    return [len(word) for word in request.prompt.split()]


def finished(request: Generate, finish_reason: str = "length") -> Finished:
    """The fake model's answer: the prompt ids + 100, text naming the request."""
    ids = prompt_ids(request)
    samples = [
        CompletionSample(
            index=index,
            token_ids=[token + 100 + index for token in ids],
            text=f"out-{request.request_id}-{index}",
            finish_reason=finish_reason,
        )
        for index in range(request.sampling.n)
    ]
    return Finished(
        request_id=request.request_id,
        completion=WireCompletion(
            request_id=request.request_id, prompt_token_ids=ids, samples=samples
        ),
        usage=Usage(prompt_tokens=len(ids), completion_tokens=len(ids) * request.sampling.n),
        timings=Timings(queue_s=0.25, ttft_s=0.5, total_s=1.5),
    )


def answer(message: ClientMessage, *, finish_delay: float = 0.0) -> Replies:
    """A well-behaved server, Finished after ``finish_delay``."""
    if isinstance(message, Generate):
        replies: Replies = [
            (0.0, Accepted(request_id=message.request_id, prompt_token_ids=prompt_ids(message)))
        ]
        if message.stream:
            replies += [
                (0.0, Delta(request_id=message.request_id, index=0, token_ids=[i], text=f"t{i}"))
                for i in range(3)
            ]
        return [*replies, (finish_delay, finished(message))]
    if isinstance(message, Abort):
        return [(0.0, AbortAck(request_id=message.request_id, aborted=True))]
    if isinstance(message, Health):
        status = HealthStatus(status="ok", workers_ready=1, workers_expected=1, step=7, uptime_s=3)
        return [(0.0, status)]
    if isinstance(message, Inspect):
        reply = InspectReply(snapshot=None, workers=[], config={}, model="tiny", frontend="fake")
        return [(0.0, reply)]
    return [(0.0, Pong())]


class FakeServer:
    """A ROUTER on ``address`` answering every frame through ``handler``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.handler: Handler = answer
        self.received: list[tuple[float, ClientMessage]] = []
        self.sent: list[ServerMessage] = []
        self._outbox: queue.SimpleQueue[ServerMessage] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def messages(self, kind: type[M]) -> list[M]:
        return [m for _, m in list(self.received) if isinstance(m, kind)]

    def push(self, message: ServerMessage) -> None:
        """Send ``message`` now, unasked, to the client that sent the last frame."""
        self._outbox.put(message)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = SAFETY_S) -> bool:
        """Whether ``predicate()`` came true (checked until ``timeout``, a safety net)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.01)
        return predicate()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _serve(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        self.configure(socket)
        socket.bind(self.address)
        self._ready.set()
        order = itertools.count()
        pending: list[tuple[float, int, bytes, ServerMessage]] = []
        last_identity: bytes | None = None
        try:
            while not self._stop.is_set():
                while last_identity is not None and not self._outbox.empty():
                    heapq.heappush(pending, (0.0, next(order), last_identity, self._outbox.get()))
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    _, _, identity, reply = heapq.heappop(pending)
                    socket.send_multipart([identity, encode(reply)])
                    self.sent.append(reply)
                wait = 0.01 if not pending else min(0.01, max(0.0, pending[0][0] - now))
                if socket.poll(int(wait * 1000) + 1):
                    identity, payload = socket.recv_multipart()
                    last_identity = identity
                    message = client_decoder.decode(payload)
                    self.received.append((time.monotonic(), message))
                    for delay, reply in self.handler(message):
                        due = time.monotonic() + delay
                        heapq.heappush(pending, (due, next(order), identity, reply))
        finally:
            socket.close()
            context.term()

    def configure(self, socket: zmq.Socket) -> None:
        """Hook for socket options (CURVE)."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FakeServer]:
    fake = FakeServer(f"ipc://{tmp_path}/fe.sock")
    fake.start()
    yield fake
    fake.stop()


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine``; it fails after SAFETY_S instead of hanging the suite."""
    return asyncio.run(asyncio.wait_for(coroutine, SAFETY_S))


async def until(condition: Callable[[], object], what: str) -> None:
    """Wait, on the running loop, until ``condition()`` holds; fail after SAFETY_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SAFETY_S
    while not condition():
        if loop.time() > deadline:
            pytest.fail(f"{what}: not within {SAFETY_S:g} s")
        await asyncio.sleep(0.005)


def finish_after_pings(count: int) -> Handler:
    """A server that answers a Generate at once with Accepted (and, streaming, its
    Deltas) but sends its Finished only after ``count`` Pings came meanwhile (each
    answered with a Pong), so a request completes only if the client pinged while it
    waited: pings counted, not seconds."""
    held: dict[str, tuple[Generate, int]] = {}

    def handler(message: ClientMessage) -> Replies:
        replies = answer(message)
        if isinstance(message, Generate):
            held[message.request_id] = (message, 0)
            return replies[:-1]
        if isinstance(message, Ping):
            for request_id, (request, pings) in list(held.items()):
                if pings + 1 < count:
                    held[request_id] = (request, pings + 1)
                else:
                    del held[request_id]
                    replies.append((0.0, finished(request)))
        return replies

    return handler


def record_pings(client: AsyncClient) -> list[bool]:
    """For each Ping ``client`` sends from now on: whether a call was waiting then."""
    pings: list[bool] = []
    send_nowait = client._send_nowait

    def recording(message: ClientMessage) -> None:
        if isinstance(message, Ping):
            pings.append(client._waiting())
        send_nowait(message)

    client._send_nowait = recording  # type: ignore[method-assign]
    return pings


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error_class"),
    [
        (ErrorCode.BAD_REQUEST, BadRequestError),
        (ErrorCode.DUPLICATE, BadRequestError),
        (ErrorCode.UNKNOWN_REQUEST, UnknownRequestError),
        (ErrorCode.REJECTED, RequestRejectedError),
        (ErrorCode.OVERLOADED, OverloadedError),
        (ErrorCode.WORKER_LOST, WorkerLostError),
        (ErrorCode.QUARANTINED, QuarantinedError),
        (ErrorCode.SHUTTING_DOWN, ShuttingDownError),
        (ErrorCode.INTERNAL, InternalServerError),
    ],
)
def test_error_from_reply(code: ErrorCode, error_class: type[ServerError]) -> None:
    error = error_from_reply(ErrorReply(request_id="r1", code=code, message="no way"))
    assert type(error) is error_class
    assert (error.code, error.message, error.request_id) == (code, "no way", "r1")
    assert str(error) == f"{code.value}: no way"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is error_class and str(copy) == str(error)


def test_client_timeout_error() -> None:
    error = ClientTimeoutError("req-7", 2.5, "generate")
    assert isinstance(error, TimeoutError)
    assert "req-7" in str(error) and "2.5" in str(error)
    assert pickle.loads(pickle.dumps(error)).request_id == "req-7"


# -- AsyncClient -----------------------------------------------------------------------------


def test_generate_round_trip(server: FakeServer) -> None:
    async def main() -> ClientCompletion:
        async with AsyncClient(server.address) as client:
            return await client.generate("hello big world", request_id="r1", n=2, seed=3)

    completion = run(main())
    assert isinstance(completion, ClientCompletion)
    assert completion.request_id == "r1"
    assert completion.prompt_token_ids == [5, 3, 5]
    assert completion.token_ids == [105, 103, 105]
    assert completion.text == "out-r1-0"
    assert completion.finish_reason == "length"
    assert [sample.index for sample in completion.samples] == [0, 1]
    assert completion.samples[1].token_ids == [106, 104, 106]
    assert completion.usage == Usage(prompt_tokens=3, completion_tokens=6)
    assert completion.timings == Timings(queue_s=0.25, ttft_s=0.5, total_s=1.5)
    (request,) = server.messages(Generate)
    assert isinstance(request, Generate)
    assert request.prompt == "hello big world" and request.prompt_token_ids is None
    assert request.stream is False
    assert (request.sampling.n, request.sampling.seed) == (2, 3)


def test_generate_token_ids_and_priority(server: FakeServer) -> None:
    async def main() -> ClientCompletion:
        async with AsyncClient(server.address) as client:
            return await client.generate(prompt_token_ids=[1, 2], priority=5, max_tokens=4)

    completion = run(main())
    assert isinstance(completion, ClientCompletion)
    assert completion.prompt_token_ids == [1, 2] and len(completion.request_id) == 32
    (request,) = server.messages(Generate)
    assert isinstance(request, Generate)
    assert request.priority == 5 and request.sampling.max_tokens == 4 and request.prompt is None


def test_stream_yields_deltas_then_ends(server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            stream = client.stream(prompt_token_ids=[4, 5], request_id="s1", temperature=0)
            deltas = [delta async for delta in stream]
            assert [d.token_ids for d in deltas] == [[0], [1], [2]]
            assert [d.text for d in deltas] == ["t0", "t1", "t2"]
            assert all(d.request_id == "s1" and d.index == 0 for d in deltas)
            assert stream.prompt_token_ids == [4, 5]
            assert stream.completion is not None
            assert stream.completion.token_ids == [104, 105]
            assert [delta async for delta in stream] == []  # done stays done
            assert not client._requests

    run(main())
    (request,) = server.messages(Generate)
    assert isinstance(request, Generate) and request.stream is True


@pytest.mark.parametrize(
    ("code", "error_class", "accepted_first"),
    [
        ("overloaded", OverloadedError, False),
        ("rejected", RequestRejectedError, False),
        ("bad_request", BadRequestError, False),
        ("worker_lost", WorkerLostError, True),
    ],
)
def test_error_replies_raise(
    server: FakeServer, code: str, error_class: type[ServerError], accepted_first: bool
) -> None:
    def refuse(message: ClientMessage) -> Replies:
        if not isinstance(message, Generate):
            return answer(message)
        error = ErrorReply(request_id=message.request_id, code=code, message="sorry")
        accepted = Accepted(request_id=message.request_id, prompt_token_ids=[1])
        return [(0.0, accepted), (0.02, error)] if accepted_first else [(0.0, error)]

    server.handler = refuse

    async def main() -> None:
        async with AsyncClient(server.address) as client:
            with pytest.raises(error_class) as caught:
                await client.generate("x", request_id="e1")
            assert caught.value.request_id == "e1" and caught.value.code == code
            with pytest.raises(error_class):
                async for _ in client.stream("x"):
                    pass
            assert not client._requests

    run(main())


def test_concurrent_generates_answered_out_of_order(server: FakeServer) -> None:
    count = 20

    held: list[Generate] = []

    def reversed_order(message: ClientMessage) -> Replies:
        """Accept each request at once; once all arrived, finish them last first."""
        if not isinstance(message, Generate):
            return answer(message)
        held.append(message)
        replies = answer(message)[:1]
        if len(held) == count:
            replies += [(0.0, finished(request)) for request in reversed(held)]
        return replies

    server.handler = reversed_order

    async def main() -> list[ClientCompletion]:
        async with AsyncClient(server.address) as client:
            return await asyncio.gather(
                *(client.generate(prompt_token_ids=[i], request_id=f"c{i}") for i in range(count))
            )

    completions = run(main())
    assert isinstance(completions, list)
    for i, completion in enumerate(completions):
        assert completion.request_id == f"c{i}"
        assert completion.token_ids == [i + 100]
        assert completion.text == f"out-c{i}-0"
    finish_order = [m.request_id for m in server.sent if isinstance(m, Finished)]
    assert finish_order == [m.request_id for m in reversed(held)]
    assert finish_order != sorted(finish_order)


def test_pings_while_a_request_is_pending(server: FakeServer) -> None:
    """The server finishes the request only after four Pings, so it completes only
    because the client pinged while it waited; once nothing waits, the pinger parks."""
    server.handler = finish_after_pings(4)

    async def main() -> tuple[ClientCompletion, list[bool]]:
        async with AsyncClient(server.address, ping_interval=0.05) as client:
            pings = record_pings(client)
            completion = await client.generate("slow", request_id="slow")
            await until(lambda: not client._work.is_set(), "the pinger going idle")
            assert not client._waiting()
            return completion, pings

    completion, pings = run(main())
    assert completion.request_id == "slow" and completion.text == "out-slow-0"
    assert len(pings) >= 4 and all(pings), pings  # every Ping while a call waited
    assert server.wait_for(lambda: len(server.messages(Ping)) == len(pings))  # all went out


def test_timeout_raises_and_aborts(server: FakeServer) -> None:
    def never_finish(message: ClientMessage) -> Replies:
        replies = answer(message)
        return replies[:1] if isinstance(message, Generate) else replies

    server.handler = never_finish

    async def main() -> None:
        async with AsyncClient(server.address, timeout=0.2) as client:
            with pytest.raises(ClientTimeoutError) as caught:
                await client.generate("x", request_id="late-1")
            error = caught.value
            assert (error.request_id, error.timeout, error.operation) == ("late-1", 0.2, "generate")
            assert "late-1" in str(error) and "0.2" in str(error)
            assert [m.request_id for m in server.messages(Generate)] == ["late-1"]  # sent
            with pytest.raises(ClientTimeoutError, match="late-2"):
                async for _ in client.stream("x", request_id="late-2", timeout=0.1):
                    pass
            assert not client._requests

    run(main())
    assert server.wait_for(lambda: len(server.messages(Abort)) == 2)
    assert [m.request_id for m in server.messages(Abort)] == ["late-1", "late-2"]


def test_cancelled_generate_is_aborted(server: FakeServer) -> None:
    server.handler = lambda message: answer(message)[:1] if isinstance(message, Generate) else []

    async def main() -> None:
        async with AsyncClient(server.address) as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.generate("x", request_id="gone"), 0.1)
            assert not client._requests

    run(main())
    assert server.wait_for(lambda: bool(server.messages(Abort)))
    assert server.messages(Abort) == [Abort(request_id="gone")]


def test_leaving_a_stream_early_aborts(server: FakeServer) -> None:
    server.handler = lambda message: answer(message, finish_delay=5.0)

    async def main() -> None:
        async with AsyncClient(server.address) as client:
            async with client.stream("x", request_id="brk") as stream:
                async for _ in stream:
                    break
            assert stream.completion is None and not client._requests
            async for _ in client.stream("x", request_id="dropped"):
                break  # no context manager: dropping the stream aborts it
            await until(lambda: not client._requests, "the dropped stream forgotten")

    run(main())
    assert server.wait_for(lambda: len(server.messages(Abort)) == 2)
    assert {m.request_id for m in server.messages(Abort)} == {"brk", "dropped"}


def test_abort_inspect_health_ping(server: FakeServer) -> None:
    def handler(message: ClientMessage) -> Replies:
        if isinstance(message, Generate):
            return answer(message)[:1]  # runs until aborted
        if isinstance(message, Ping):
            return []  # the test sends the Pong itself
        if isinstance(message, Abort):
            if message.request_id == "nope":
                return [(0.0, ErrorReply(request_id="nope", code="unknown_request", message="?"))]
            request = Generate(request_id=message.request_id, prompt_token_ids=[1])
            return [
                (0.0, AbortAck(request_id=message.request_id, aborted=True)),
                (0.0, finished(request, finish_reason="abort")),
            ]
        return answer(message)

    server.handler = handler

    async def main() -> None:
        # no Pings of the client's own here: the one Ping the server gets is ping()'s
        async with AsyncClient(server.address, ping_interval=60, server_timeout_s=120) as client:
            task = asyncio.create_task(client.generate("x", request_id="victim"))
            await until(lambda: server.messages(Generate), "the request reaching the server")
            assert await client.abort("victim") is True
            completion = await task
            assert completion.finish_reason == "abort"
            with pytest.raises(UnknownRequestError):
                await client.abort("nope")
            health = await client.health()
            assert health.status == "ok" and health.step == 7
            reply = await client.inspect()
            assert reply.model == "tiny" and reply.snapshot is None
            pinging = asyncio.create_task(client.ping())
            await until(lambda: server.messages(Ping), "the Ping reaching the server")
            assert not pinging.done()  # no Pong yet
            server.push(Pong())
            round_trip = await pinging
            assert isinstance(round_trip, float) and 0 <= round_trip < math.inf
            assert not client._abort_waiters

    run(main())


def test_unattributed_error_fails_the_waiting_control_call(server: FakeServer) -> None:
    def handler(message: ClientMessage) -> Replies:
        if isinstance(message, Health):
            return [(0.0, ErrorReply(request_id=None, code="shutting_down", message="bye"))]
        return answer(message)

    server.handler = handler

    async def main() -> None:
        async with AsyncClient(server.address) as client:
            with pytest.raises(ShuttingDownError):
                await client.health()
            assert (await client.inspect()).model == "tiny"

    run(main())


def test_control_timeout(server: FakeServer) -> None:
    server.handler = lambda message: []

    async def main() -> None:
        async with AsyncClient(server.address, timeout=0.1) as client:
            with pytest.raises(ClientTimeoutError, match="health"):
                await client.health()
            with pytest.raises(ClientTimeoutError, match="ping") as caught:
                await client.ping()
            assert caught.value.request_id is None and caught.value.timeout == 0.1

    run(main())


def test_invalid_arguments_raise_before_sending(server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            with pytest.raises(InvalidRequestError, match="temperature"):
                await client.generate("x", temperature=-1.0)
            with pytest.raises(InvalidRequestError, match="top_p"):
                client.stream("x", top_p=0.0)
            with pytest.raises(InvalidRequestError, match="bogus"):
                await client.generate("x", bogus=1)
            with pytest.raises(ValueError, match="exactly one"):
                await client.generate()
            with pytest.raises(ValueError, match="exactly one"):
                await client.generate("x", prompt_token_ids=[1])
            with pytest.raises(ValueError, match="timeout"):
                await client.generate("x", timeout=-1)
            # One socket, frames in order: whatever was sent before this reached the
            # server before it.
            assert (await client.health()).status == "ok"

    run(main())
    sent = [type(m) for _, m in server.received if not isinstance(m, Ping)]  # keep-alives
    assert sent == [Health]


def test_duplicate_in_flight_id_is_refused_locally(server: FakeServer) -> None:
    server.handler = lambda message: answer(message)[:1] if isinstance(message, Generate) else []

    async def main() -> None:
        async with AsyncClient(server.address) as client:
            first = asyncio.create_task(client.generate("x", request_id="same"))
            await until(lambda: server.messages(Generate), "the first request sent")
            with pytest.raises(BadRequestError, match="duplicate"):
                await client.generate("y", request_id="same")
            (request,) = server.messages(Generate)
            server.push(finished(request))  # only now does the first one end
            assert (await first).request_id == "same"

    run(main())
    assert len(server.messages(Generate)) == 1


def test_close_fails_waiting_calls(server: FakeServer) -> None:
    server.handler = lambda message: answer(message, finish_delay=5.0)

    async def main() -> None:
        client = AsyncClient(server.address)
        task = asyncio.create_task(client.generate("x"))
        await until(lambda: server.messages(Generate), "the request reaching the server")
        await client.close()
        with pytest.raises(ClientClosedError):
            await task
        with pytest.raises(ClientClosedError):
            await client.health()
        await client.close()

    run(main())


def test_curve(tmp_path: Path) -> None:
    server_public, server_secret = zmq.curve_keypair()

    class CurveServer(FakeServer):
        def configure(self, socket: zmq.Socket) -> None:
            socket.curve_server = True
            socket.curve_secretkey = server_secret

    fake = CurveServer(f"ipc://{tmp_path}/fe.sock")
    fake.start()
    try:

        async def main() -> None:
            async with AsyncClient(fake.address, curve_server_key=server_public) as client:
                assert (await client.health()).status == "ok"

        run(main())
    finally:
        fake.stop()
    with pytest.raises(ValueError, match="curve_server_key"):
        AsyncClient("ipc:///nowhere", curve_public_key=server_public)


# -- Client ------------------------------------------------------------------------------------


def test_sync_client_basics(server: FakeServer) -> None:
    """Every request finishes only after three Pings: the sync client pings while a call
    blocks."""
    pinged = finish_after_pings(3)

    def handler(message: ClientMessage) -> Replies:
        if isinstance(message, Generate) and message.request_id == "bad":
            return [(0.0, ErrorReply(request_id="bad", code="overloaded", message="full"))]
        if isinstance(message, Generate) and message.request_id == "hang":
            return answer(message)[:1]
        return pinged(message)

    server.handler = handler
    with Client(server.address, ping_interval=0.05, timeout=5) as client:
        completion = client.generate("a b", request_id="g1", max_tokens=2)
        assert completion.token_ids == [101, 101] and completion.text == "out-g1-0"
        stream = client.stream(prompt_token_ids=[9], request_id="s1")
        assert [delta.text for delta in stream] == ["t0", "t1", "t2"]
        assert stream.completion is not None and stream.completion.token_ids == [109]
        assert client.health().status == "ok"
        assert client.inspect().frontend == "fake"
        assert client.abort("g1") is True
        with pytest.raises(OverloadedError):
            client.generate("x", request_id="bad")
        with pytest.raises(InvalidRequestError):
            client.generate("x", n=0)
        with pytest.raises(ClientTimeoutError, match="hang"):
            client.generate("x", request_id="hang", timeout=0.1)
    assert client.closed
    with pytest.raises(ClientClosedError):
        client.health()

    # the abort of "hang" goes out after the call timed out; "g1"'s went out earlier
    assert server.wait_for(lambda: Abort(request_id="hang") in server.messages(Abort))


# -- server liveness -------------------------------------------------------------------------

FAST = {"ping_interval": 0.05, "server_timeout_s": 1.0}
"""Liveness settings for the tests: a silent server is given up after 1 s (20 ping
intervals: a loaded machine stalling the fake server for a while is not silence)."""
PINGS_PAST_TIMEOUT = 25
"""Pings that take longer than FAST's server_timeout_s: the client pings at most once
per ping_interval, so 25 of them span at least 24 x 0.05 = 1.2 s."""


def test_server_unavailable_error() -> None:
    error = ServerUnavailableError("ipc:///run/x.sock", 5.0)
    assert isinstance(error, ConnectionError)
    assert (error.address, error.silent_s) == ("ipc:///run/x.sock", 5.0)
    assert str(error) == "no answer from the server at ipc:///run/x.sock for 5 s; is it running?"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.address, copy.silent_s, str(copy)) == (error.address, 5.0, str(error))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"server_timeout_s": 0}, "server_timeout_s"),
        ({"server_timeout_s": -1.0}, "server_timeout_s"),
        ({"server_timeout_s": math.inf}, "server_timeout_s"),
        ({"server_timeout_s": math.nan}, "server_timeout_s"),
        ({"server_timeout_s": True}, "server_timeout_s"),
        ({"server_timeout_s": "5"}, "server_timeout_s"),
        ({"ping_interval": 0.0}, "ping_interval"),
        ({"ping_interval": math.inf}, "ping_interval"),
        ({"ping_interval": 2.0, "server_timeout_s": 2.0}, "server_timeout_s.*ping_interval"),
        ({"server_timeout_s": 0.5}, "server_timeout_s.*ping_interval"),  # default interval 1 s
    ],
)
def test_liveness_parameters_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AsyncClient("ipc:///nowhere", **kwargs)
    with pytest.raises(ValueError, match=match):
        Client("ipc:///nowhere", **kwargs)


def test_silent_server_fails_every_waiting_call(server: FakeServer) -> None:
    """A server that stops answering (not even Pongs) fails a generate, a stream, a
    health call and an abort, all without a timeout of their own."""

    def silent(message: ClientMessage) -> Replies:
        if isinstance(message, Generate) and message.stream:
            return answer(message)[:2]  # Accepted and one Delta, then nothing
        return []

    server.handler = silent

    async def consume(client: AsyncClient) -> list[str]:
        return [delta.text async for delta in client.stream("x", request_id="s1")]

    async def main() -> list[BaseException | Any]:
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            calls = [
                client.generate("x", request_id="g1"),
                consume(client),
                client.health(timeout=None),
                client.abort("g1", timeout=None),
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert not client._requests and not client._waiting()
            return results

    results = run(main())
    for result in results:
        assert isinstance(result, ServerUnavailableError), result
        # the silence it reports is what it waited for: it never gives up earlier
        assert result.address == server.address
        assert result.silent_s >= FAST["server_timeout_s"]
        assert server.address in str(result)
    # the abandoned requests are aborted without waiting, in case the server is only stalled
    assert server.wait_for(lambda: len(server.messages(Abort)) == 3)
    assert sorted(m.request_id for m in server.messages(Abort)) == ["g1", "g1", "s1"]


def test_a_server_that_stops_answering_midway(server: FakeServer) -> None:
    """Answers (a stream's deltas) count as signs of life until they stop. The server
    never sends a Pong; it answers each of the client's Pings with the stream's next
    Delta, PINGS_PAST_TIMEOUT of them (longer than server_timeout_s), then falls
    silent."""
    deltas: list[Delta] = []

    def deltas_then_silence(message: ClientMessage) -> Replies:
        if isinstance(message, Generate):
            rid = message.request_id
            deltas.extend(
                Delta(request_id=rid, index=0, token_ids=[i], text=f"t{i}")
                for i in range(1, PINGS_PAST_TIMEOUT + 1)
            )
            return [(0.0, Accepted(request_id=rid, prompt_token_ids=[1]))]
        if isinstance(message, Ping) and deltas:
            return [(0.0, deltas.pop(0))]
        return []

    server.handler = deltas_then_silence

    async def main() -> list[str]:
        texts: list[str] = []
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            with pytest.raises(ServerUnavailableError):
                async for delta in client.stream("x"):
                    texts.append(delta.text)
        return texts

    assert run(main()) == [f"t{i}" for i in range(1, PINGS_PAST_TIMEOUT + 1)]


def test_stopped_server_fails_calls_and_a_restarted_one_serves(server: FakeServer) -> None:
    server.handler = lambda message: answer(message, finish_delay=60.0)

    async def main() -> None:
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            pending = asyncio.create_task(client.generate("x", request_id="lost"))
            await until(lambda: server.messages(Generate), "the request reaching the server")
            await asyncio.to_thread(server.stop)
            with pytest.raises(ServerUnavailableError):
                await pending
            with pytest.raises(ServerUnavailableError):  # still gone: the same again
                await client.health(timeout=None)
            restarted = FakeServer(server.address)
            restarted.start()
            try:
                completion = await client.generate("y z", request_id="back")
                assert completion.token_ids == [101, 101]
                assert (await client.health(timeout=None)).status == "ok"
            finally:
                await asyncio.to_thread(restarted.stop)

    run(main())


def test_pongs_keep_a_long_request_alive(server: FakeServer) -> None:
    """A request running far longer than server_timeout_s, with no frame of its own
    meanwhile, lives on the Pongs to the client's pings: the server finishes it only
    after PINGS_PAST_TIMEOUT Pings."""
    server.handler = finish_after_pings(PINGS_PAST_TIMEOUT)

    async def main() -> ClientCompletion:
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            return await client.generate("long one", request_id="long")

    completion = run(main())
    assert completion.request_id == "long" and completion.text == "out-long-0"
    assert not server.messages(Abort)


def test_idle_time_does_not_count(server: FakeServer) -> None:
    """Silence while nothing waits is no sign of a dead server: after an idle period
    longer than server_timeout_s, a call answered within it succeeds. The idle period
    is made by turning back, just before each call, when the client last heard from the
    server (as if ten server_timeout_s had passed in silence); a client that counted
    it would fail the call at once, before its answer, which comes 0.1 s late."""

    def slowish(message: ClientMessage) -> Replies:
        return [(0.1, reply) for _, reply in answer(message)]  # Pongs too: 0.1 s late

    server.handler = slowish

    def idle_for_long(client: AsyncClient) -> None:
        assert not client._waiting()
        client._last_heard -= 10 * FAST["server_timeout_s"]

    async def main() -> None:
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            assert (await client.health()).status == "ok"
            idle_for_long(client)  # and no await before the call: nothing is heard meanwhile
            assert (await client.health()).status == "ok"
            idle_for_long(client)
            assert (await client.generate("a", request_id="after-idle")).text == "out-after-idle-0"

    run(main())
    assert not server.messages(Abort)


def test_sends_stuck_on_a_full_socket_give_up(tmp_path: Path) -> None:
    """No server ever: with a send high-water mark of 1 the sends themselves block, and
    still every call fails with ServerUnavailableError."""
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.SNDHWM, 1)

    async def main() -> list[BaseException | Any]:
        address = f"ipc://{tmp_path}/nobody.sock"
        async with AsyncClient(address, timeout=None, context=context, **FAST) as client:
            calls = [
                *(client.generate("x") for _ in range(5)),
                client.inspect(),
                client.abort("any"),
            ]
            tasks = [asyncio.ensure_future(call) for call in calls]
            await until(lambda: client._stuck_sends, "a send held up by the full socket")
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert not client._stuck_sends
            return results

    try:
        results = run(main())
    finally:
        context.term()
    assert all(isinstance(result, ServerUnavailableError) for result in results), results


def test_sync_client_server_unavailable(server: FakeServer) -> None:
    server.handler = lambda message: []
    with Client(server.address, timeout=None, **FAST) as client:
        with pytest.raises(ServerUnavailableError):
            in_thread(lambda: client.generate("x"))  # no timeout of its own: it gives up
        with pytest.raises(ServerUnavailableError):
            in_thread(lambda: list(client.stream("x")))
        server.handler = answer
        assert client.generate("a", request_id="ok").text == "out-ok-0"
