"""No reply is lost silently between the scheduler's frontend and a client (issue 29,
item 2): a reply dropped on the way fails the client's waiting calls with
:class:`RepliesLostError` instead of leaving them to wait for ever; replies to a client
whose pipe is full are held back in order, not dropped; a client that reads nothing
past the backlog bound has its requests aborted; and a client whose event loop was
blocked longer than its ``server_timeout_s`` does not fail its own calls."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import zmq
import zmq.asyncio
from support.frontend_bench import Bench, running_frontend
from support.limits import SAFETY_S

from ipc.async_client import AsyncClient, RepliesLostError
from ipc.schema import (
    Accepted,
    Finished,
    Generate,
    Ping,
    Pong,
    Timings,
    Usage,
    client_decoder,
    encode,
    server_decoder,
)
from scheduler_svc.launch import free_port
from shared.outputs import Completion, CompletionSample, FinishReason
from shared.server_config import ServerConfig


def _client(bench: Bench, **options: float) -> AsyncClient:
    options.setdefault("ping_interval", 0.05)
    options.setdefault("server_timeout_s", 30.0)  # only a lost reply may fail a call here
    return AsyncClient(bench.address, timeout=SAFETY_S, context=bench.context, **options)  # type: ignore[arg-type]


def test_a_reply_dropped_on_the_way_fails_the_call_instead_of_hanging() -> None:
    """The frontend's Accepted for the request never reaches the socket (dropped on
    purpose, after it was numbered): the client sees the gap at the next Pong and the
    call fails with RepliesLostError. Unnumbered, it would wait for a Finished that the
    server never sends (it holds the request as accepted): until the safety timeout."""

    async def main() -> None:
        async with running_frontend() as bench:
            outbox = bench.frontend.outbox
            real = outbox._try_send
            dropped: list[object] = []

            def lossy(frames: list[bytes]) -> str:
                if isinstance(server_decoder.decode(frames[1]), Accepted):
                    dropped.append(frames)
                    return "sent"  # as if it left, but it never arrives
                return real(frames)

            outbox._try_send = lossy  # type: ignore[method-assign]
            async with _client(bench) as client:
                with pytest.raises(RepliesLostError, match="missing"):
                    await client.generate(prompt_token_ids=[1, 7], max_tokens=4)
                assert dropped
                # The client stays usable: later calls are answered.
                assert await client.ping() > 0

    asyncio.run(main())


def test_replies_to_a_full_pipe_are_held_back_in_order_not_dropped() -> None:
    """With the pipe to the client full (high-water marks of 2), 200 replies sent at
    once all arrive, in order, numbered 0..199 (before: every reply beyond the pipe's
    room was dropped without a trace)."""

    async def main() -> None:
        async with running_frontend(sndhwm=2) as bench:
            dealer = bench.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 2)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(bench.address)
            try:
                await dealer.send(encode(Ping(sequenced=True)))
                frames = await asyncio.wait_for(dealer.recv_multipart(), SAFETY_S)
                assert isinstance(server_decoder.decode(frames[0]), Pong)
                assert int.from_bytes(frames[1], "big") == 0
                identity = next(iter(bench.frontend.clients))
                for _ in range(200):  # at once: the pipe fills, the rest wait
                    bench.frontend.send(identity, Pong())
                assert bench.frontend.outbox.backlogs  # some were held back
                numbers = []
                for _ in range(200):
                    frames = await asyncio.wait_for(dealer.recv_multipart(), SAFETY_S)
                    numbers.append(int.from_bytes(frames[1], "big"))
                assert numbers == list(range(1, 201))
                assert bench.frontend.outbox.dropped == 0
            finally:
                dealer.close(linger=0)

    asyncio.run(main())


def test_a_client_that_reads_nothing_past_the_bound_has_its_requests_aborted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The backlog of a client that reads nothing grows past max_reply_backlog_bytes:
    it is dropped (logged), the client's requests are aborted on the server, and the
    client, once it reads again, sees the gap and fails its waiting call."""

    async def main() -> None:
        server = ServerConfig(max_reply_backlog_bytes=4096)
        async with running_frontend(server=server, sndhwm=2) as bench:
            frontend = bench.frontend
            async with _client(bench) as client:
                task = asyncio.ensure_future(
                    client.generate(prompt_token_ids=[1, 7], max_tokens=4, request_id="r")
                )
                deadline = time.monotonic() + SAFETY_S
                while "r" not in frontend.outputs.requests and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                identity = frontend.outputs.requests["r"].client
                for _ in range(5000):  # without yielding: the client cannot read meanwhile
                    frontend.send(identity, Pong())
                assert frontend.outbox.dropped > 0
                assert frontend.outputs.requests["r"].ending  # aborted on the server
                with pytest.raises(RepliesLostError):
                    await task

    with caplog.at_level(logging.WARNING, logger="expeditor.scheduler"):
        asyncio.run(main())
    assert "max_reply_backlog_bytes=4096" in caplog.text


class _SlowServer:
    """A ROUTER in its own thread: accepts a Generate, answers pings, and finishes the
    request at the first Ping after ``release`` is set."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.release = threading.Event()
        self.accepted = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> _SlowServer:
        self._thread.start()
        assert self._ready.wait(SAFETY_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(SAFETY_S)

    def _serve(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        self._ready.set()
        pending: list[str] = []
        try:
            while not self._stop.is_set():
                if not socket.poll(10):
                    continue
                identity, payload = socket.recv_multipart()
                message = client_decoder.decode(payload)
                replies: list[object] = []
                if isinstance(message, Generate):
                    pending.append(message.request_id)
                    replies.append(Accepted(request_id=message.request_id, prompt_token_ids=[1]))
                    self.accepted.set()
                elif isinstance(message, Ping):
                    replies.append(Pong())
                    if self.release.is_set():
                        replies.extend(_finished(rid) for rid in pending)
                        pending.clear()
                for reply in replies:
                    socket.send_multipart([identity, encode(reply)])  # type: ignore[arg-type]
        finally:
            socket.close()
            context.term()


def _finished(request_id: str) -> Finished:
    sample = CompletionSample(index=0, token_ids=[9], text="ok", finish_reason=FinishReason.LENGTH)
    return Finished(
        request_id=request_id,
        completion=Completion(request_id=request_id, prompt_token_ids=[1], samples=[sample]),
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(queue_s=0.0, ttft_s=0.0, total_s=0.0),
    )


def test_a_blocked_event_loop_does_not_fail_the_clients_own_calls(tmp_path: object) -> None:
    """The client's loop blocks for 4x its server_timeout_s while a request is in
    flight (the server alive all along): the request still succeeds. Before, the pinger
    woke to 2 s of "silence" (no ping had gone out to be answered) and failed it with
    ServerUnavailableError."""

    async def main(address: str, server: _SlowServer) -> None:
        async with AsyncClient(
            address, timeout=SAFETY_S, ping_interval=0.1, server_timeout_s=0.5
        ) as client:
            task = asyncio.ensure_future(client.generate(prompt_token_ids=[1], max_tokens=1))
            assert await asyncio.to_thread(server.accepted.wait, SAFETY_S)
            await asyncio.sleep(0.3)  # pings answered: the client is in steady state
            time.sleep(2.0)  # the loop blocked (e.g. a huge request parsed on it)
            server.release.set()
            completion = await task
            assert completion.text == "ok"

    address = f"ipc://{tmp_path}/slow.sock"
    with _SlowServer(address) as server:
        asyncio.run(main(address, server))


def test_a_server_restarted_before_any_numbered_reply_fails_the_waiting_call() -> None:
    """The scheduler takes a request and dies before any reply of that busy period left
    it; a new one comes up at the same address before the client's server_timeout_s.
    Its replies are numbered from 0 as if this client had only been idle, so numbering
    alone sees nothing lost; the new run's Pong does (another instance), and the call
    fails instead of waiting for ever."""

    async def main() -> None:
        address = f"tcp://127.0.0.1:{free_port()}"
        context = zmq.asyncio.Context()
        client = AsyncClient(address, timeout=SAFETY_S, context=context, ping_interval=0.05)
        try:
            async with running_frontend(address=address) as first:
                assert await client.ping() > 0  # the client knows this run, then idles
                await asyncio.sleep(0.2)
                first.frontend.outbox._try_send = lambda frames: "sent"  # type: ignore[method-assign]
                # From here on the first run answers nothing: it takes the request and
                # dies before a single reply of this busy period leaves it.
                waiting = asyncio.ensure_future(
                    client.generate(prompt_token_ids=[1, 7], max_tokens=4)
                )
                while not first.frontend.outputs.requests:
                    await asyncio.sleep(0.01)
            async with running_frontend(address=address):
                with pytest.raises(RepliesLostError, match="restarted"):
                    await asyncio.wait_for(waiting, SAFETY_S)
        finally:
            await client.close()
            context.term()

    asyncio.run(main())
