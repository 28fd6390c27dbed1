"""ipc.client against a scripted fake frontend (a ROUTER socket in a thread)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import pickle
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zmq
import zmq.asyncio

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
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def messages(self, kind: type[M]) -> list[M]:
        return [m for _, m in list(self.received) if isinstance(m, kind)]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 2.0) -> bool:
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
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    _, _, identity, reply = heapq.heappop(pending)
                    socket.send_multipart([identity, encode(reply)])
                    self.sent.append(reply)
                wait = 0.01 if not pending else min(0.01, max(0.0, pending[0][0] - now))
                if socket.poll(int(wait * 1000) + 1):
                    identity, payload = socket.recv_multipart()
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
    return asyncio.run(asyncio.wait_for(coroutine, 10))


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
    server.handler = lambda message: answer(message, finish_delay=0.5)

    async def main() -> float:
        async with AsyncClient(server.address, ping_interval=0.05) as client:
            await client.generate("slow")
            done = time.monotonic()
            await asyncio.sleep(0.25)
            return done

    done = run(main())
    assert isinstance(done, float)
    ((sent, _),) = [(t, m) for t, m in server.received if isinstance(m, Generate)]
    pings = [t for t, m in server.received if isinstance(m, Ping)]
    assert len([t for t in pings if sent < t < done]) >= 4
    assert not [t for t in pings if t > done + 0.1]  # idle: no pings


def test_timeout_raises_and_aborts(server: FakeServer) -> None:
    def never_finish(message: ClientMessage) -> Replies:
        replies = answer(message)
        return replies[:1] if isinstance(message, Generate) else replies

    server.handler = never_finish

    async def main() -> None:
        async with AsyncClient(server.address, timeout=0.2) as client:
            started = time.monotonic()
            with pytest.raises(ClientTimeoutError) as caught:
                await client.generate("x", request_id="late-1")
            assert 0.15 < time.monotonic() - started < 1.0
            assert caught.value.request_id == "late-1" and "late-1" in str(caught.value)
            assert "0.2" in str(caught.value)
            with pytest.raises(ClientTimeoutError, match="late-2"):
                async for _ in client.stream("x", request_id="late-2", timeout=0.1):
                    pass
            assert not client._requests

    run(main())
    assert server.wait_for(lambda: len(server.messages(Abort)) == 2)
    assert [m.request_id for m in server.messages(Abort)] == ["late-1", "late-2"]


def test_cancelled_generate_is_aborted(server: FakeServer) -> None:
    server.handler = lambda message: answer(message, finish_delay=5.0)

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
            await asyncio.sleep(0.05)
            assert not client._requests

    run(main())
    assert server.wait_for(lambda: len(server.messages(Abort)) == 2)
    assert {m.request_id for m in server.messages(Abort)} == {"brk", "dropped"}


def test_abort_inspect_health_ping(server: FakeServer) -> None:
    def handler(message: ClientMessage) -> Replies:
        if isinstance(message, Generate):
            return answer(message)[:1]  # runs until aborted
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
        async with AsyncClient(server.address) as client:
            task = asyncio.create_task(client.generate("x", request_id="victim"))
            await asyncio.sleep(0.05)
            assert await client.abort("victim") is True
            completion = await task
            assert completion.finish_reason == "abort"
            with pytest.raises(UnknownRequestError):
                await client.abort("nope")
            health = await client.health()
            assert health.status == "ok" and health.step == 7
            reply = await client.inspect()
            assert reply.model == "tiny" and reply.snapshot is None
            assert await client.ping() >= 0
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
            await asyncio.sleep(0.1)

    run(main())
    assert server.received == []


def test_duplicate_in_flight_id_is_refused_locally(server: FakeServer) -> None:
    server.handler = lambda message: answer(message, finish_delay=0.2)

    async def main() -> None:
        async with AsyncClient(server.address) as client:
            first = asyncio.create_task(client.generate("x", request_id="same"))
            await asyncio.sleep(0.05)
            with pytest.raises(BadRequestError, match="duplicate"):
                await client.generate("y", request_id="same")
            assert (await first).request_id == "same"

    run(main())
    assert len(server.messages(Generate)) == 1


def test_close_fails_waiting_calls(server: FakeServer) -> None:
    server.handler = lambda message: answer(message, finish_delay=5.0)

    async def main() -> None:
        client = AsyncClient(server.address)
        task = asyncio.create_task(client.generate("x"))
        await asyncio.sleep(0.05)
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
    def handler(message: ClientMessage) -> Replies:
        if isinstance(message, Generate) and message.request_id == "bad":
            return [(0.0, ErrorReply(request_id="bad", code="overloaded", message="full"))]
        if isinstance(message, Generate) and message.request_id == "hang":
            return answer(message)[:1]
        return answer(message, finish_delay=0.3)

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

    generates = [t for t, m in server.received if isinstance(m, Generate)]
    finished_at = generates[0] + 0.3
    pings = [t for t, m in server.received if isinstance(m, Ping)]
    assert len([t for t in pings if generates[0] < t < finished_at]) >= 3
    assert server.wait_for(lambda: bool(server.messages(Abort)))
    assert Abort(request_id="hang") in server.messages(Abort)


# -- server liveness -------------------------------------------------------------------------

FAST = {"ping_interval": 0.05, "server_timeout_s": 0.3}
"""Liveness settings for the tests: a silent server is given up after 0.3 s."""
BOUND_S = 5.0
"""A generous bound on how long giving up may take."""


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
            async with asyncio.timeout(BOUND_S):
                results = await asyncio.gather(*calls, return_exceptions=True)
            assert not client._requests and not client._waiting()
            return results

    results = run(main())
    for result in results:
        assert isinstance(result, ServerUnavailableError), result
        assert result.address == server.address and result.silent_s >= 0.3
        assert server.address in str(result)
    # the abandoned requests are aborted without waiting, in case the server is only stalled
    assert server.wait_for(lambda: len(server.messages(Abort)) == 3)
    assert sorted(m.request_id for m in server.messages(Abort)) == ["g1", "g1", "s1"]
    assert len(server.messages(Ping)) >= 3


def test_a_server_that_stops_answering_midway(server: FakeServer) -> None:
    """Answers (a stream's deltas) count as signs of life until they stop."""

    def slow_then_silent(message: ClientMessage) -> Replies:
        if not isinstance(message, Generate):
            return []
        rid = message.request_id
        deltas: Replies = [
            (0.1 * i, Delta(request_id=rid, index=0, token_ids=[i], text=f"t{i}"))
            for i in range(1, 9)
        ]
        return [(0.0, Accepted(request_id=rid, prompt_token_ids=[1])), *deltas]

    server.handler = slow_then_silent

    async def main() -> list[str]:
        texts: list[str] = []
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            with pytest.raises(ServerUnavailableError):
                async with asyncio.timeout(BOUND_S):
                    async for delta in client.stream("x"):
                        texts.append(delta.text)
        return texts

    assert run(main()) == [f"t{i}" for i in range(1, 9)]  # 0.8 s of deltas, then silence


def test_stopped_server_fails_calls_and_a_restarted_one_serves(server: FakeServer) -> None:
    server.handler = lambda message: answer(message, finish_delay=60.0)

    async def main() -> None:
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            pending = asyncio.create_task(client.generate("x", request_id="lost"))
            await asyncio.sleep(0.1)
            await asyncio.to_thread(server.stop)
            async with asyncio.timeout(BOUND_S):
                with pytest.raises(ServerUnavailableError):
                    await pending
                with pytest.raises(ServerUnavailableError):  # still gone: the same again
                    await client.health(timeout=None)
            restarted = FakeServer(server.address)
            restarted.start()
            try:
                async with asyncio.timeout(BOUND_S):
                    completion = await client.generate("y z", request_id="back")
                assert completion.token_ids == [101, 101]
                assert (await client.health(timeout=None)).status == "ok"
            finally:
                await asyncio.to_thread(restarted.stop)

    run(main())


def test_pongs_keep_a_long_request_alive(server: FakeServer) -> None:
    """A request running far longer than server_timeout_s, with no frame of its own
    meanwhile, lives on the Pongs to the client's pings."""
    server.handler = lambda message: answer(message, finish_delay=1.2)

    async def main() -> ClientCompletion:
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            return await client.generate("long one", request_id="long")

    completion = run(main())
    assert completion.request_id == "long"
    assert len(server.messages(Ping)) >= 10
    assert not server.messages(Abort)


def test_idle_time_does_not_count(server: FakeServer) -> None:
    """Silence while nothing waits is no sign of a dead server: after an idle period
    longer than server_timeout_s, a call answered within it succeeds."""

    def slowish(message: ClientMessage) -> Replies:
        return [(0.1, reply) for _, reply in answer(message)]  # Pongs too: 0.1 s late

    server.handler = slowish

    async def main() -> None:
        async with AsyncClient(server.address, timeout=None, **FAST) as client:
            assert (await client.health()).status == "ok"
            await asyncio.sleep(0.8)
            assert (await client.health()).status == "ok"
            await asyncio.sleep(0.8)
            assert (await client.generate("a", request_id="after-idle")).text == "out-after-idle-0"

    run(main())


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
            await asyncio.sleep(0.1)
            assert client._stuck_sends
            async with asyncio.timeout(BOUND_S):
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
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError):
            client.generate("x")
        with pytest.raises(ServerUnavailableError):
            list(client.stream("x"))
        assert time.monotonic() - started < 2 * BOUND_S
        server.handler = answer
        assert client.generate("a", request_id="ok").text == "out-ok-0"
