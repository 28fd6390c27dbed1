"""Hostile input and faults against real `expeditor serve` processes: frames that used
to stop the server, prompts that crashed workers or froze the loop, aborts across
clients, draining on SIGTERM, prompt worker replacement, fairness between clients."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.limits import SERVE_SAFETY_S
from support.serve import children_in_role, rss_mb

from gpu_worker.tiny_model import VOCAB_SIZE
from ipc.client import AsyncClient, Client
from ipc.errors import (
    BadRequestError,
    ClientClosedError,
    QuarantinedError,
    RequestRejectedError,
    ShuttingDownError,
    UnknownRequestError,
)
from ipc.schema import ErrorReply, client_decoder, server_decoder
from scheduler_svc.launch import running_server
from shared.errors import InvalidRequestError


@pytest.fixture(scope="module")
def server(model: Path):
    with running_server(
        model,
        "--num-gpu-blocks",
        "256",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--max-frame-bytes",
        "12000000",
        "--max-prompt-bytes",
        "2500000",
    ) as (address, proc):
        yield address, proc


def _pid_of(proc: subprocess.Popen[bytes], role: str) -> int:
    pids = children_in_role(proc.pid, role)
    assert pids, f"no {role} process"
    return pids[0]


class _Raw:
    """A bare DEALER socket: frames the client library would never send."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, frame: bytes, timeout_s: float = 10.0) -> object | None:
        self.sock.send(frame)
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return server_decoder.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)


def _serving(address: str) -> None:
    with Client(address, timeout=60) as client:
        assert client.health().status == "ok"
        assert client.generate("still serving", max_tokens=2).usage.completion_tokens >= 1


# -- 1. frames --------------------------------------------------------------------------


def test_deeply_nested_frames_get_an_error_and_the_server_goes_on(server) -> None:
    address, proc = server
    raw = _Raw(address)
    try:
        replies = [
            raw.ask(frame)
            for frame in (
                b"\x81\xa1a" * 1000 + b"\xc0",  # 1,000 nested maps: RecursionError before
                b"\x91" * 100_000 + b"\xc0",  # nested arrays
                b"\x82\xa4type\xa8generate\xaarequest_id" + b"\x81\xa1a" * 5000 + b"\xc0",
            )
        ]
        for reply in replies:
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
            assert reply.request_id is None
        assert "nested too deeply" in replies[0].message  # type: ignore[union-attr]
    finally:
        raw.close()
    assert proc.poll() is None
    _serving(address)


def _nested(leaves: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=40,
    )


_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=50)
    | st.binary(max_size=50)
)
_TAGS = st.sampled_from(["generate", "abort", "inspect", "health", "ping", "bogus", ""])
_FRAMES = st.one_of(
    st.binary(max_size=200),
    _nested(_LEAVES).map(msgspec.msgpack.encode),
    st.builds(
        lambda tag, body: msgspec.msgpack.encode({"type": tag, **body}),
        _TAGS,
        st.dictionaries(
            st.sampled_from(["request_id", "prompt", "prompt_token_ids", "sampling", "stream"]),
            _nested(_LEAVES),
        ),
    ),
    st.integers(min_value=100_000, max_value=1_000_000).map(
        lambda size: msgspec.msgpack.encode({"type": "abort", "request_id": "x" * size})
    ),
    st.integers(min_value=10, max_value=3000).map(lambda depth: b"\x91" * depth + b"\xc0"),
)


def test_any_frame_gets_exactly_one_answer_and_the_server_goes_on(server) -> None:
    """Hypothesis-made frames: random bytes, msgpack of nested maps and arrays, tagged
    messages with wrongly typed fields, huge strings. Each frame that is not a valid
    request is answered with one ErrorReply; the server keeps serving."""
    address, proc = server
    raw = _Raw(address)

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_FRAMES)
    def probe(frame: bytes) -> None:
        try:
            message = client_decoder.decode(frame)
        except Exception:
            message = None
        if message is not None:  # a valid message: it is served, not the point here
            return
        reply = raw.ask(frame)
        assert isinstance(reply, ErrorReply), reply
        assert reply.code == "bad_request" and reply.request_id is None, reply
        assert not raw.sock.poll(0), "more than one answer to one frame"

    try:
        probe()
    finally:
        raw.close()
    assert proc.poll() is None
    _serving(address)


def test_a_frame_above_max_frame_bytes_disconnects_its_sender_only(server) -> None:
    address, proc = server
    raw = _Raw(address)
    try:
        assert raw.ask(b"\x00" * 13_000_000, timeout_s=3.0) is None  # dropped, no answer
    finally:
        raw.close()
    assert proc.poll() is None
    _serving(address)


# -- 2. prompts against the model --------------------------------------------------------


@pytest.mark.parametrize("token", [VOCAB_SIZE, 10**9, 2**63 - 1, 2**64 - 1])
def test_token_ids_outside_the_vocabulary_are_bad_requests(server, token: int) -> None:
    address, proc = server
    raw = _Raw(address)
    try:
        frame = msgspec.msgpack.encode(
            {"type": "generate", "request_id": f"oov-{token}", "prompt_token_ids": [1, token]}
        )
        reply = raw.ask(frame)
    finally:
        raw.close()
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
    assert reply.request_id == f"oov-{token}"
    assert str(token) in reply.message and "vocabulary" in reply.message
    assert reply.field == "prompt_token_ids"
    assert proc.poll() is None
    _serving(address)


def test_a_request_with_nothing_to_draw_fails_alone_and_the_worker_serves_on(server) -> None:
    """Constraints that mask every token: the request fails naming why, again and again,
    while a request beside it finishes and the worker stays the same process (with
    overlapped scheduling the next step is planned before the worker's NO_TOKEN is back,
    and computes that position)."""
    address, proc = server
    worker = _pid_of(proc, "worker")

    async def scenario() -> None:
        async with AsyncClient(address) as client:
            beside = asyncio.ensure_future(
                client.generate(prompt_token_ids=[1, 9], max_tokens=60, ignore_eos=True)
            )
            for n in (1, 2, 1):
                with pytest.raises(BadRequestError, match="no token could be drawn") as info:
                    await client.generate(
                        prompt_token_ids=[1, 7], max_tokens=6, n=n, ignore_eos=True,
                        allowed_token_ids=[7], bad_words_token_ids=[[7]],
                    )  # fmt: skip
                assert "allowed_token_ids, bad_words" in str(info.value)
            done = await beside
            assert done.finish_reason == "length" and done.usage.completion_tokens == 60

    asyncio.run(scenario())
    assert _pid_of(proc, "worker") == worker and proc.poll() is None
    _serving(address)


def test_a_generate_the_server_cannot_read_is_refused_to_its_own_request(server) -> None:
    """Fields the schema refuses (an over-long user, sampling values that fail their
    checks, an unknown sampling field): the error names the request, so the client's
    call fails at once instead of waiting for its timeout."""
    address, proc = server
    with Client(address, timeout=30) as client:
        for fields, words in (
            ({"user": "u" * 257}, "user"),
            ({"sampling": {"temperature": float("nan")}}, "temperature"),
            ({"sampling": {"bogus": 1}}, "bogus"),
        ):
            started = time.monotonic()
            with pytest.raises(BadRequestError, match="malformed message") as info:
                client.generate("hi", **fields)  # type: ignore[arg-type]
            assert words in str(info.value) and time.monotonic() - started < 10
        assert client.generate("still serving", max_tokens=2).usage.completion_tokens >= 1
    assert proc.poll() is None


def test_values_a_frame_cannot_carry_are_refused_by_the_client(server) -> None:
    """A lone surrogate, integers past 64 bits: InvalidRequestError (naming the field
    where the sampling checks see it) instead of the encoder's own error, and the client
    goes on."""
    address, _ = server
    with Client(address, timeout=30) as client:
        for args, fields, words in (
            (("bad \ud800",), {}, "surrogates not allowed"),
            (("x",), {"max_tokens": 2**70}, "max_tokens: must be at most"),
            (("x",), {"top_k": 2**64}, "top_k: must be at most"),
            ((), {"prompt_token_ids": [2**64]}, "cannot be sent"),
            (("x",), {"priority": 2**70}, "cannot be sent"),
        ):
            with pytest.raises(InvalidRequestError, match=re.escape(words)):
                client.generate(*args, **fields)  # type: ignore[arg-type]
        assert client.generate("fine", max_tokens=2).usage.completion_tokens >= 1


def test_closing_a_client_aborts_its_requests_at_once(server) -> None:
    """A client closed with a stream and a call in flight: the calls fail with
    ClientClosedError and the server aborts both requests at once (not after its
    client_timeout_s of silence)."""
    address, _ = server

    async def scenario() -> None:
        client = AsyncClient(address)
        stream = client.stream(prompt_token_ids=[1, 8], max_tokens=500, ignore_eos=True)
        deltas = stream.__aiter__()
        await deltas.__anext__()
        call = asyncio.ensure_future(
            client.generate(prompt_token_ids=[1, 9], max_tokens=500, ignore_eos=True)
        )
        await asyncio.sleep(0.1)
        await client.close()
        with pytest.raises(ClientClosedError):
            await call

    with Client(address) as client:
        before = client.inspect().snapshot
        assert before is not None
        asyncio.run(scenario())
        deadline = time.monotonic() + 30
        while (after := client.inspect().snapshot) is not None and after.seqs:
            assert time.monotonic() < deadline, [s.seq_id for s in after.seqs]
            time.sleep(0.1)
        assert after is not None
    ended = {k: after.finished.get(k, 0) - before.finished.get(k, 0) for k in after.finished}
    assert ended.get("abort") == 2 and not ended.get("length"), ended  # not run to the end


# -- 3. big prompts ---------------------------------------------------------------------


def test_a_prompt_beyond_max_prompt_bytes_is_refused_before_tokenizing(server) -> None:
    address, _ = server
    with Client(address, timeout=30) as client:
        with pytest.raises(BadRequestError, match="max_prompt_bytes=2500000") as refused:
            client.generate("a" * 10_000_000, max_tokens=1)
    assert "10000000 bytes" in str(refused.value)
    _serving(address)


def test_a_long_prompt_is_served_beside_others_and_memory_returns(server) -> None:
    """A 2.4 MB prompt (seconds of tokenizing, on a thread: tests/service/test_frontend.py shows
    the loop stays free meanwhile) is refused once tokenized, other clients are served
    alongside it, and the scheduler's memory comes back down afterwards."""
    address, proc = server
    scheduler = _pid_of(proc, "scheduler")
    _serving(address)
    baseline = rss_mb(scheduler)

    async def scenario() -> None:
        async with AsyncClient(address, timeout=120) as big, AsyncClient(address) as small:

            async def send_big() -> None:
                with pytest.raises(RequestRejectedError, match="max_model_len"):
                    await big.generate("ab" * 1_200_000, max_tokens=1)  # 2.4M tokens

            async def send_small() -> None:
                for _ in range(3):
                    await small.ping()
                    await small.generate(prompt_token_ids=[1, 5, 6], max_tokens=1)

            await asyncio.gather(send_big(), send_small())

    asyncio.run(scenario())
    assert rss_mb(scheduler) < baseline + 100


# -- 9. aborts ----------------------------------------------------------------------------


def test_abort_semantics_and_ownership(server) -> None:
    address, _ = server

    async def scenario() -> None:
        async with AsyncClient(address) as owner, AsyncClient(address) as other:
            done = await owner.generate(prompt_token_ids=[1, 7], max_tokens=2, request_id="fin")
            assert done.finish_reason == "length"
            assert await owner.abort("fin") is False  # already finished
            with pytest.raises(UnknownRequestError):
                await other.abort("fin")  # not its request
            stream = owner.stream(
                prompt_token_ids=[1, 8], max_tokens=400, ignore_eos=True, request_id="mine"
            )
            deltas = stream.__aiter__()
            await deltas.__anext__()
            with pytest.raises(UnknownRequestError):
                await other.abort("mine")
            assert await owner.abort("mine") is True
            assert await owner.abort("mine") is False  # a repeat
            async for _ in deltas:
                pass
            assert stream.completion is not None
            assert stream.completion.finish_reason == "abort"

    asyncio.run(scenario())


# -- 10. fairness ------------------------------------------------------------------------


def test_a_light_client_is_not_starved_by_a_heavy_one(server) -> None:
    """max_num_seqs is 4. A heavy client queues 40 long streams; a light client's three
    short requests sent afterwards finish while most of the heavy ones have not started."""
    address, _ = server

    async def scenario() -> int:
        async with AsyncClient(address, timeout=300) as heavy, AsyncClient(address) as light:
            streams = [
                heavy.stream(prompt_token_ids=[1, 20 + i], max_tokens=40, ignore_eos=True)
                for i in range(40)
            ]

            async def drain(stream) -> None:
                async for _ in stream:
                    pass

            tasks = [asyncio.ensure_future(drain(s)) for s in streams]
            while sum(1 for s in streams if s.prompt_token_ids is not None) < 40:
                await asyncio.sleep(0.05)  # every heavy request is accepted (queued)
            # The light client's requests go together: one after the other, each would
            # also wait for its client's round trip, and a slot freed meanwhile goes to
            # a heavy request (how many then finish first depends on that timing).
            await asyncio.gather(
                *(light.generate(prompt_token_ids=[1, 3 + i], max_tokens=2) for i in range(3))
            )
            finished = sum(1 for t in tasks if t.done())
            await asyncio.gather(*tasks)
            return finished

    heavy_finished = asyncio.run(scenario())
    # The old strict order served all 40 heavy requests first.
    assert heavy_finished <= 12, heavy_finished


# -- 6. drain on SIGTERM ------------------------------------------------------------------


def test_sigterm_drains_in_flight_requests_then_exits_zero(model: Path) -> None:
    with running_server(model, "--num-gpu-blocks", "256") as (address, proc):

        async def scenario() -> tuple[list[str], BaseException | None]:
            async with AsyncClient(address, timeout=120) as client:
                tasks = [
                    asyncio.ensure_future(
                        client.generate(prompt_token_ids=[1, 9 + i], max_tokens=60, ignore_eos=True)
                    )
                    for i in range(6)
                ]
                while (await client.inspect()).snapshot.num_running < 1:  # type: ignore[union-attr]
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                while (await client.health()).status != "draining":
                    await asyncio.sleep(0.02)
                refused: BaseException | None = None
                try:
                    await client.generate(prompt_token_ids=[1, 2], max_tokens=2)
                except ShuttingDownError as exc:
                    refused = exc
                results = await asyncio.gather(*tasks)
                return [r.finish_reason for r in results], refused

        reasons, refused = asyncio.run(scenario())
        assert proc.wait(timeout=60) == 0
    assert reasons == ["length"] * 6
    assert isinstance(refused, ShuttingDownError)


def test_requests_left_after_shutdown_timeout_fail_with_a_reason(model: Path) -> None:
    # One sequence at a time: the last of four 2,000-token requests cannot be done
    # within the 1 s drain however fast the steps are.
    flags = ("--num-gpu-blocks", "256", "--shutdown-timeout-s", "1", "--max-num-seqs", "1")
    with running_server(model, *flags) as (address, proc):

        async def scenario() -> BaseException:
            async with AsyncClient(address, timeout=120) as client:
                streams = [
                    client.stream(prompt_token_ids=[1, 4 + i], max_tokens=2000, ignore_eos=True)
                    for i in range(4)
                ]
                first = streams[0].__aiter__()
                rest = [asyncio.ensure_future(_drain_stream(s)) for s in streams[1:]]
                await first.__anext__()
                proc.send_signal(signal.SIGTERM)
                outcomes = await asyncio.gather(_drain_stream(first), *rest)
                assert isinstance(outcomes[-1], ShuttingDownError), outcomes
                return outcomes[-1]

        error = asyncio.run(scenario())
        assert proc.wait(timeout=60) == 0
    assert "shutdown_timeout_s=1" in str(error)


async def _drain_stream(stream: AsyncIterator[object]) -> BaseException | None:
    """Read a stream to its end: the exception it ended with, or None."""
    try:
        async for _ in stream:
            pass
    except Exception as exc:
        return exc
    return None


# -- 8. worker replacement --------------------------------------------------------------


def test_a_dead_workers_replacement_is_accepted_at_once(model: Path) -> None:
    """worker_timeout_s is 120 s: before, the replacement was refused until the dead
    worker's heartbeats timed out; now its death is seen at once."""
    flags = ("--num-gpu-blocks", "128", "--worker-timeout-s", "120")
    with running_server(model, *flags) as (address, proc):
        with Client(address, timeout=60) as client:
            first = client.generate(prompt_token_ids=[1, 5], max_tokens=30, temperature=0.0)
            worker = _pid_of(proc, "worker")
            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline:
                workers = client.inspect().workers
                ready = [w for w in workers if w.state == "ready"]
                if ready and ready[0].pid != worker:
                    break
                time.sleep(0.1)
            else:
                pytest.fail("the replacement worker was not accepted within 45 s")
            again = client.generate(prompt_token_ids=[1, 5], max_tokens=30, temperature=0.0)
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "stalls"])
def test_quarantine_after_two_failed_steps(model: Path, fault: signal.Signals) -> None:
    """A request in flight when a worker dies twice is failed as quarantined; one that
    came after the first failure is served. A worker that stalls (SIGSTOP: silent past
    worker_timeout_s, then killed by the scheduler and replaced) counts as one that
    died."""
    flags = ("--num-gpu-blocks", "128", "--max-model-len", "1024", "--worker-timeout-s", "2")
    with running_server(model, *flags) as (address, _):

        async def running(client: AsyncClient, request_id: str, *, not_on: int = 0) -> int:
            """Wait until ``request_id`` runs, with K/V on a ready worker other than pid
            ``not_on`` (a worker already killed); that worker's pid."""
            deadline = time.monotonic() + SERVE_SAFETY_S
            while True:
                reply = await client.inspect()
                assert reply.snapshot is not None
                workers = [w.pid for w in reply.workers if w.state == "ready" and w.pid != not_on]
                if workers and any(
                    s.request_id == request_id
                    and s.state == "running"
                    and s.num_output_tokens
                    and s.num_computed_tokens
                    for s in reply.snapshot.seqs
                ):
                    return workers[0]
                assert time.monotonic() < deadline, f"{request_id} never ran on a new worker"
                await asyncio.sleep(0.02)

        async def lost(client: AsyncClient, pid: int) -> None:
            """Wait until the scheduler has seen worker ``pid`` gone."""
            deadline = time.monotonic() + SERVE_SAFETY_S
            while not any(
                w.pid == pid and w.state == "lost" for w in (await client.inspect()).workers
            ):
                assert time.monotonic() < deadline, f"worker {pid} never seen lost"
                await asyncio.sleep(0.02)

        async def scenario() -> tuple[BaseException | None, str]:
            async with AsyncClient(address, timeout=120) as client:
                victim = asyncio.ensure_future(
                    client.generate(
                        prompt_token_ids=[1, 6], max_tokens=900, ignore_eos=True, request_id="v"
                    )
                )
                first = await running(client, "v")
                os.kill(first, fault)
                await lost(client, first)  # so the later request was not in that step
                later = asyncio.ensure_future(
                    client.generate(prompt_token_ids=[1, 7], max_tokens=40, ignore_eos=True)
                )
                os.kill(await running(client, "v", not_on=first), fault)
                try:
                    await victim
                    error = None
                except Exception as exc:
                    error = exc
                return error, (await later).finish_reason

        error, later_reason = asyncio.run(scenario())
    assert isinstance(error, QuarantinedError), error
    assert "not retried" in str(error)
    assert later_reason == "length"


def test_serve_under_ctrl_c_drains_too(model: Path) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C) stops serve in order."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "expeditor", "serve", "--model", str(model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().decode().strip()
        assert address.startswith("ipc://"), address

        async def scenario() -> str:
            async with AsyncClient(address, timeout=120) as client:
                task = asyncio.ensure_future(
                    client.generate(prompt_token_ids=[1, 9], max_tokens=60, ignore_eos=True)
                )
                deadline = time.monotonic() + SERVE_SAFETY_S
                while not (await client.inspect()).snapshot.num_running:  # type: ignore[union-attr]
                    assert time.monotonic() < deadline, "the request never ran"
                    await asyncio.sleep(0.02)
                os.killpg(proc.pid, signal.SIGINT)  # while it runs
                return (await task).finish_reason

        assert asyncio.run(scenario()) == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
