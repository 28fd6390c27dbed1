"""End to end: real `expeditor serve` processes on the tiny model, driven through the
client library; greedy outputs checked against transformers run alone."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from support.blocking import until_async
from support.hf_reference import Oracle
from support.limits import SERVE_SAFETY_S
from support.serve import children_in_role, generate_all

from ipc.client import AsyncClient, Client
from ipc.errors import (
    BadRequestError,
    OverloadedError,
    RequestRejectedError,
    UnknownRequestError,
    WorkerLostError,
)
from ipc.schema import (
    ErrorReply,
    Generate,
    HealthState,
    InspectReply,
    SchedulerSnapshot,
    SeqInfo,
    SeqStatus,
    StepTimes,
    WorkerStatus,
    encode,
    server_decoder,
)
from scheduler_svc.launch import running_server
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams

MAX_TOKENS = 10


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 259) for _ in range(24)]
    prompts = []
    for index in range(count):
        length = rng.randint(3, 60)
        body = [rng.randrange(3, 259) for _ in range(length)]
        prompts.append([1, *(shared if index % 4 == 0 else []), *body])
    return prompts


PROMPTS = _prompts(32)


@pytest.fixture(scope="module")
def expected(model: Path, hf_oracle: Oracle) -> list[list[int]]:
    return hf_oracle(model, PROMPTS, MAX_TOKENS)


def _inspect(address: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "expeditor", "inspect", "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    ("mode", "overlap"), [("swap", True), ("recompute", True), ("swap", False)]
)
def test_32_concurrent_requests_match_transformers(
    model: Path, expected, mode: str, overlap: bool
) -> None:
    """Greedy outputs equal transformers' with the next step planned while one runs
    (the default) and without (so both modes give identical outputs)."""
    flags = [
        "--overlap-scheduling" if overlap else "--no-overlap-scheduling",
        "--num-gpu-blocks",
        "40",
        "--block-size",
        "4",
        "--preemption-mode",
        mode,
        "--max-num-batched-tokens",
        "96",
        "--watermark",
        "0",
    ]
    if mode == "swap":
        flags += ["--num-cpu-blocks", "256"]
    with running_server(model, *flags) as (address, _):
        outputs = asyncio.run(generate_all(address, PROMPTS, MAX_TOKENS, timeout=120))
        state = _inspect(address)
    for index, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"prompt {index} ({mode})"
    preemptions = state["scheduler"]["preemptions"]
    assert preemptions[mode] > 0, preemptions
    assert state["workers"][0]["state"] == "ready"
    assert {"rank", "pid", "device", "state"} <= set(state["workers"][0])
    assert state["scheduler"]["gpu_blocks"]["free"] == 40


@pytest.fixture(scope="module")
def server(model: Path):
    with running_server(
        model,
        "--num-gpu-blocks",
        "128",
        "--max-waiting-requests",
        "64",
        "--client-timeout-s",
        "2",
        "--max-model-len",
        "256",
    ) as (address, proc):
        yield address, proc


def test_streaming_deltas_concatenate_to_the_final_text(server) -> None:
    address, _ = server
    with Client(address) as client:
        stream = client.stream("Stream me, please", max_tokens=24, temperature=0.0, n=2)
        deltas = list(stream)
        completion = stream.completion
    assert completion is not None
    for sample in completion.samples:
        mine = [d for d in deltas if d.index == sample.index]
        assert "".join(d.text for d in mine) == sample.text
        assert [t for d in mine for t in d.token_ids] == sample.token_ids
        assert mine[-1].finish_reason == sample.finish_reason


def test_stop_string_ends_generation(server) -> None:
    address, _ = server
    with Client(address) as client:
        full = client.generate("Stop strings", max_tokens=30, temperature=0.0)
        assert len(full.text) >= 8
        stop = full.text[4:6]
        cut = full.text.find(stop)
        stopped = client.generate("Stop strings", max_tokens=30, temperature=0.0, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_abort_mid_stream_frees_blocks(server) -> None:
    address, _ = server

    async def scenario() -> tuple[str | None, dict]:
        async with AsyncClient(address) as client:
            stream = client.stream(
                prompt_token_ids=[1] + [50] * 100,
                max_tokens=150,
                ignore_eos=True,
                request_id="long-one",
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 5:
                    assert await client.abort("long-one") is True
            busy = await client.inspect()
            return stream.completion.finish_reason if stream.completion else None, busy

    reason, _ = asyncio.run(scenario())
    assert reason == "abort"
    state = _inspect(address)
    assert state["scheduler"]["gpu_blocks"]["free"] == state["scheduler"]["gpu_blocks"]["total"]
    assert state["scheduler"]["finished"]["abort"] >= 1


def test_bad_input_gets_errors_and_the_server_keeps_serving(server) -> None:
    address, _ = server
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(address)
    try:
        for frame in (b"\x00garbage", encode(Generate(request_id="x")), b"\x81\xa4type\xa5bogus"):
            raw.send(frame)
            assert raw.poll(10_000)
            reply = server_decoder.decode(raw.recv())
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
        raw.send(b"\x83\xa4type\xa8generate\xaarequest_id\xa1y\xb0prompt_token_ids\x91\xa3abc")
        assert raw.poll(10_000)
        reply = server_decoder.decode(raw.recv())
        assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
        assert "prompt_token_ids" in reply.message
        # Sampling values the client library would refuse, sent raw: NaN, negative, bool.
        cases = (
            (b"\xabtemperature\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00", "temperature"),
            (b"\xa5top_p\xcb\xbf\xf0\x00\x00\x00\x00\x00\x00", "top_p"),
            (b"\xa1n\xc3", "sampling.n"),
        )
        for sampling, field in cases:
            raw.send(
                b"\x84\xa4type\xa8generate\xaarequest_id\xa1z\xb0prompt_token_ids\x91\x05"
                b"\xa8sampling\x81" + sampling
            )
            assert raw.poll(10_000)
            reply = server_decoder.decode(raw.recv())
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
            assert field in reply.message
    finally:
        raw.close(linger=0)
    with Client(address) as client:
        with pytest.raises(InvalidRequestError):
            client.generate("hi", temperature=-1.0)
        with pytest.raises(RequestRejectedError, match="max_model_len"):
            client.generate(prompt_token_ids=[5] * 300, max_tokens=4)
        with pytest.raises(UnknownRequestError):
            client.abort("nobody")
        assert (
            client.generate("still here", max_tokens=3, temperature=0.0).usage.completion_tokens
            == 3
        )

    async def duplicates() -> None:
        # Two clients, one id: the server refuses the second while the first is live (a
        # client refuses its own duplicates before sending).
        async with AsyncClient(address) as first, AsyncClient(address) as second:
            stream = first.stream(
                prompt_token_ids=[1, 5, 6], max_tokens=250, ignore_eos=True, request_id="dup"
            )
            deltas = stream.__aiter__()
            await deltas.__anext__()  # it is running now
            with pytest.raises(BadRequestError, match="in use") as refused:
                await second.generate("again", request_id="dup")
            assert refused.value.code == "duplicate"
            async for _ in deltas:
                pass

    asyncio.run(duplicates())


def test_waiting_queue_bound_answers_overloaded(server) -> None:
    address, _ = server

    async def flood() -> list[BaseException | object]:
        async with AsyncClient(address, timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.generate(prompt_token_ids=[1, 9, 9], max_tokens=64, ignore_eos=True)
                    for _ in range(400)
                ),
                return_exceptions=True,
            )

    results = asyncio.run(flood())
    overloaded = [r for r in results if isinstance(r, OverloadedError)]
    assert overloaded, "no request was refused as overloaded"
    assert all(not isinstance(r, BaseException) or isinstance(r, OverloadedError) for r in results)
    with Client(address) as client:
        assert client.health().status == "ok"


def test_a_client_that_disappears_has_its_requests_aborted(server) -> None:
    address, _ = server
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(address)
    raw.send(
        encode(
            Generate(
                request_id="orphan",
                prompt_token_ids=[1] + [7] * 40,
                sampling=SamplingParams(max_tokens=1000, ignore_eos=True),
            )
        )
    )
    assert raw.poll(10_000)
    raw.close(linger=0)  # gone, no pings
    deadline = time.monotonic() + SERVE_SAFETY_S
    while time.monotonic() < deadline:
        state = _inspect(address)
        if not any(s["request_id"] == "orphan" for s in state["scheduler"]["seqs"]):
            break
        time.sleep(0.5)
    else:
        pytest.fail("the orphaned request was never aborted")
    assert state["scheduler"]["gpu_blocks"]["free"] == state["scheduler"]["gpu_blocks"]["total"]


def _worker_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    workers = children_in_role(proc.pid, "worker")
    assert workers, "no worker process found"
    return workers


def _on_the_worker(snapshot: SchedulerSnapshot | None) -> dict[str, SeqInfo]:
    """Sequences running with K/V on the worker (some tokens computed) and at least three
    tokens short of MAX_TOKENS, so the result of a step already finished cannot end them."""
    return {
        s.seq_id: s
        for s in (snapshot.seqs if snapshot is not None else [])
        if s.state is SeqStatus.RUNNING
        and s.num_computed_tokens > 0
        and s.num_output_tokens <= MAX_TOKENS - 3
    }


async def _kill_a_worker_running_requests(
    client: AsyncClient, proc: subprocess.Popen[bytes]
) -> tuple[int, dict[str, SeqInfo]]:
    """SIGKILL a worker of ``proc`` (``expeditor serve``) while requests run on it, and
    check that the scheduler re-queues them. Returns the killed pid and those requests'
    sequences as they stood when it died.

    The worker is first frozen (SIGSTOP): the snapshot taken then shows what runs on it,
    and nothing changes until it is killed. ``serve`` itself is frozen from before the
    kill until the re-queue has been seen, so no replacement worker can start and take
    the requests up again meanwhile; it restarts one once thawed.
    """
    os.kill(proc.pid, signal.SIGSTOP)
    frozen: int | None = None
    try:

        async def freeze_one_running_requests() -> tuple[int, dict[str, SeqInfo]] | None:
            nonlocal frozen
            if not _on_the_worker((await client.inspect()).snapshot):
                return None
            frozen = _worker_pids(proc)[0]
            os.kill(frozen, signal.SIGSTOP)
            running = _on_the_worker((await client.inspect()).snapshot)
            if running:
                return frozen, running
            os.kill(frozen, signal.SIGCONT)  # they all finished meanwhile: again
            frozen = None
            return None

        pid, running = await until_async(
            freeze_one_running_requests, "requests running on a worker"
        )
        os.kill(pid, signal.SIGKILL)

        async def requeued() -> InspectReply | None:
            reply = await client.inspect()
            lost = any(w.pid == pid and w.state is WorkerStatus.LOST for w in reply.workers)
            assert reply.snapshot is not None
            return reply if lost and reply.snapshot.num_running == 0 else None

        reply = await until_async(requeued, f"the scheduler seeing worker {pid} gone")
        assert reply.snapshot is not None
        health = await client.health()
        assert health.status is HealthState.DEGRADED, health
        assert health.workers_ready == health.workers_expected - 1, health
        # Back in the waiting queue, to be computed again from the start: nothing of
        # theirs on a device (its cache died with the worker).
        live = {s.seq_id: s for s in reply.snapshot.seqs}
        assert set(running) <= set(live), "a request on the killed worker was dropped"
        for seq_id in running:
            seq = live[seq_id]
            assert seq.state is SeqStatus.WAITING, seq
            assert seq.num_computed_tokens == 0 and seq.num_gpu_blocks == 0, seq
        assert reply.snapshot.gpu_blocks.free == reply.snapshot.gpu_blocks.total
        return pid, running
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)  # unless killed: let it go on
            except ProcessLookupError:
                pass
        os.kill(proc.pid, signal.SIGCONT)


def test_killed_worker_is_restarted_and_requests_complete(model: Path, expected) -> None:
    """A worker killed while requests run on it: they are re-queued (seen in the
    scheduler's state before any replacement can take them), a new worker is started,
    and every request completes with transformers' output."""
    flags = [
        "--num-gpu-blocks",
        "64",
        "--block-size",
        "4",
        "--num-cpu-blocks",
        "256",
        "--preemption-mode",
        "swap",
        "--max-num-batched-tokens",
        "64",
        "--watermark",
        "0",
        "--worker-timeout-s",
        "60",  # only the death counts, seen at once (the test freezes the worker first)
    ]
    with running_server(model, *flags) as (address, proc):

        async def scenario() -> tuple[list[list[int]], int, InspectReply]:
            async with AsyncClient(address, timeout=300) as client:
                tasks = [
                    asyncio.ensure_future(
                        client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0)
                    )
                    for p in PROMPTS
                ]
                killed, _ = await _kill_a_worker_running_requests(client, proc)
                results = await asyncio.gather(*tasks)
                return [r.token_ids for r in results], killed, await client.inspect()

        outputs, killed, after = asyncio.run(scenario())
    for index, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"prompt {index}"
    ready = [w for w in after.workers if w.state is WorkerStatus.READY]
    assert len(ready) == 1 and ready[0].pid != killed, after.workers


def test_without_restarts_in_flight_requests_fail_explicitly(model: Path) -> None:
    flags = [
        "--num-gpu-blocks",
        "512",
        "--no-restart-workers",
        "--worker-timeout-s",
        "2",
        "--worker-wait-s",
        "3",
    ]
    with running_server(model, *flags) as (address, proc):

        async def scenario() -> list[BaseException | object]:
            async with AsyncClient(address, timeout=60) as client:
                tasks = [
                    asyncio.ensure_future(
                        client.generate(
                            prompt_token_ids=[1, 4, 5, 6], max_tokens=1500, ignore_eos=True
                        )
                    )
                    for _ in range(4)
                ]

                async def all_running() -> bool | None:
                    snapshot = (await client.inspect()).snapshot
                    return True if snapshot is not None and snapshot.num_running == 4 else None

                await until_async(all_running, "the four requests running")
                os.kill(_worker_pids(proc)[0], signal.SIGKILL)
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(scenario())
    assert all(isinstance(r, WorkerLostError) for r in results), results


def _scheduler(
    model: Path, tmp_path: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``expeditor scheduler`` alone, on sockets in ``tmp_path`` (frontend ``fe.sock``,
    workers ``w.sock``); its stderr piped."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expeditor",
            "scheduler",
            "--model",
            str(model),
            "--frontend",
            f"ipc://{tmp_path}/fe.sock",
            "--worker-endpoint",
            f"ipc://{tmp_path}/w.sock",
            *flags,
        ],
        env=env,
        stderr=subprocess.PIPE,
    )


def test_scheduler_daemon_speaks_sd_notify(model: Path, tmp_path: Path) -> None:
    """READY=1 once serving, then WATCHDOG=1 pings, on a NOTIFY_SOCKET we provide."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = tmp_path / "notify.sock"
    sock.bind(str(notify_path))
    sock.settimeout(30)
    env = dict(
        os.environ,
        NOTIFY_SOCKET=str(notify_path),
        WATCHDOG_USEC="400000",
        PYTHONUNBUFFERED="1",
    )
    env.pop("WATCHDOG_PID", None)
    proc = _scheduler(model, tmp_path, env=env)
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and seen.count("WATCHDOG=1") < 2:
            seen += sock.recv(4096).decode().split("\n")
        assert "READY=1" in seen
        assert seen.index("READY=1") < seen.index("WATCHDOG=1")
        assert seen.count("WATCHDOG=1") >= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        sock.settimeout(5)
        assert "STOPPING=1" in sock.recv(4096).decode().split("\n")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        sock.close()


def test_generate_and_inspect_commands(server) -> None:
    address, _ = server
    run = [sys.executable, "-m", "expeditor"]
    out = subprocess.run(
        [*run, "generate", "--address", address, "Hi there", "--max-tokens", "5", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    completion = json.loads(out.stdout)
    assert len(completion["token_ids"]) <= 5 and completion["usage"]["completion_tokens"] >= 1
    streamed = subprocess.run(
        [*run, "generate", "--address", address, "Hi there", "--max-tokens", "5", "--stream"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert streamed.stdout.rstrip("\n") == completion["text"]
    table = subprocess.run(
        [*run, "inspect", "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for label in (
        "queues",
        "GPU blocks",
        "prefix cache",
        "preemptions",
        "step ms",
        "workers",
        "ready",
    ):
        assert label in table.stdout
    state = _inspect(address)  # after the requests: where their steps' time went
    parts = {"schedule", "transfer", "prepare", "swap", "forward", "sample", "outputs"}
    for key in ("step_times", "step_times_total"):
        times = state[key]
        assert set(times) == {*parts, "steps", "forward_gflops"}, times
        assert times["steps"] >= 1 and all(times[p] >= 0 for p in parts), times
        assert times["forward_gflops"] > 0, times  # the worker counted its arithmetic
    assert state["step_times"]["steps"] == min(100, state["step_times_total"]["steps"])
    missing = subprocess.run(
        [*run, "inspect", "--address", "ipc:///nonexistent/fe.sock", "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "running?" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_bench_expeditor_target_reports_step_ms(model: Path) -> None:
    """``expeditor bench --json`` for the daemons: ``step_ms`` from one final inspect."""
    from expeditor.bench.run import parse_target, report_json, run_bench
    from expeditor.bench.workloads import skewed

    load = skewed(6, seed=1, prompt_len=(8, 24), mean_output=4, max_output=8)
    results = run_bench(
        load,
        [parse_target("expeditor")],
        model=model,
        base_config={"max_num_seqs": 4, "num_gpu_blocks": 128},
        device="cpu",
        on_done=lambda label: None,
    )
    (entry,) = json.loads(report_json(load, [r for r, _ in results], seed=1, model=model))[
        "results"
    ]
    step_ms = entry["step_ms"]
    assert set(step_ms) == set(
        StepTimes.__struct_fields__
    )  # names: tests/service/test_step_times.py
    assert all(value >= 0 for value in step_ms.values()) and step_ms["steps"] >= 1, step_ms


def test_serve_refuses_mirrored_workers_naming_the_replica_flag(model: Path) -> None:
    """--workers 2 without tensor parallelism (two mirrors running every plan) stops
    before anything starts, pointing to --data-parallel-size."""
    proc = subprocess.run(
        [sys.executable, "-m", "expeditor", "serve", "--model", str(model), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=SERVE_SAFETY_S,
    )
    assert proc.returncode != 0
    message = " ".join(proc.stderr.split())  # the CLI wraps long errors
    assert "data_parallel_size = 2" in message and "--data-parallel-size 2" in message


def test_random_frames_never_take_the_server_down(server) -> None:
    """Garbage, truncated and wrongly typed frames each get an error; service goes on."""
    address, _ = server
    rng = random.Random(5)
    valid = encode(Generate(request_id="fuzz", prompt_token_ids=[1, 2, 3]))
    frames = []
    for _ in range(150):
        kind = rng.randrange(3)
        if kind == 0:
            frames.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))))
        elif kind == 1:
            frames.append(valid[: rng.randint(0, len(valid) - 1)])
        else:
            flipped = bytearray(valid)
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            frames.append(bytes(flipped))
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(address)
    try:
        for frame in frames:
            raw.send(frame)
        replies = []
        while len(replies) < len(frames) and raw.poll(5_000):
            replies.append(server_decoder.decode(raw.recv()))
        # A flipped byte can still make a valid request: it is accepted and then served.
        errors = [r for r in replies if isinstance(r, ErrorReply)]
        assert errors and all(r.code in ("bad_request", "duplicate", "rejected") for r in errors)
    finally:
        raw.close(linger=0)
    with Client(address) as client:
        assert client.health().status == "ok"
        assert client.generate("after the storm", max_tokens=3).usage.completion_tokens >= 1


def test_serve_that_cannot_serve_exits_non_zero(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "expeditor", "serve"]
    missing = subprocess.run(
        [*run, "--model", str(tmp_path / "none")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "no config.json" in missing.stderr
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"model_type": "gpt2"}')
    failing = subprocess.run(
        [*run, "--model", str(unsupported)], capture_output=True, text=True, timeout=120
    )
    assert failing.returncode == 1
    assert "model type 'gpt2' is not supported" in failing.stderr
    assert "giving up" in failing.stderr and failing.stdout == ""


HUNG_WORKER = """
import os, sys, time, zmq
from ipc.schema import Heartbeat, WorkerHello, WorkerJoin, control_decoder, encode
from shared.procinfo import host_id, process_start_time
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
# As a real worker does: its host and start time let the scheduler kill it safely.
sock.send(encode(WorkerJoin(
    rank=0, pid=os.getpid(), device="cpu", host=host_id(),
    start_time=process_start_time(os.getpid()) or 0,
)))
setup = control_decoder.decode(sock.recv())
sock.send(encode(WorkerHello(
    rank=0, pid=os.getpid(), device="cpu", num_gpu_blocks=64, kv_bytes_per_block=1024,
    block_size=setup.settings.scheduler.block_size, model=sys.argv[2], eos_token_ids=[2],
)))
while True:  # heartbeats forever, never answers a plan: a stuck kernel
    sock.send(encode(Heartbeat(rank=0)))
    if sock.poll(200):
        sock.recv()
"""


def test_a_worker_hung_inside_a_step_is_killed(model: Path, tmp_path: Path) -> None:
    workers = f"ipc://{tmp_path}/w.sock"
    scheduler = _scheduler(model, tmp_path, "--step-timeout-s", "2", "--worker-wait-s", "2")
    hung = subprocess.Popen([sys.executable, "-c", HUNG_WORKER, workers, str(model)])
    try:
        with Client(f"ipc://{tmp_path}/fe.sock", timeout=SERVE_SAFETY_S) as client:
            deadline = time.monotonic() + SERVE_SAFETY_S
            while client.health().status != "ok":
                assert time.monotonic() < deadline, "the hung worker never became ready"
                time.sleep(0.1)
            # The client waits far longer than step_timeout_s: the step timeout, not
            # the client's, ends the request.
            with pytest.raises(WorkerLostError):
                client.generate("stuck", max_tokens=4)
            assert hung.wait(timeout=SERVE_SAFETY_S) == -signal.SIGKILL
            assert client.health().status == "degraded"
    finally:
        for proc in (hung, scheduler):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert b"did not finish step" in scheduler.stderr.read()  # type: ignore[union-attr]


def test_logprobs_of_forked_samples_reach_the_client(server) -> None:
    address, _ = server
    with Client(address) as client:
        completion = client.generate(
            prompt_token_ids=[1, 70, 71, 72],
            max_tokens=5,
            n=3,
            temperature=5.0,  # spread draws: the samples' first tokens differ
            seed=3,
            logprobs=2,
        )
    assert len({s.token_ids[0] for s in completion.samples}) > 1
    for sample in completion.samples:
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
            # The 2 most likely tokens, plus the sample's own token when it is not one.
            top2 = sorted(entry, key=entry.__getitem__, reverse=True)[:2]
            assert token in entry and set(entry) - set(top2) <= {token}, entry
