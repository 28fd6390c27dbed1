"""One soak run (benchmarks/soak.py) against a running ``expeditor serve``: the load lanes,
aborts and client disconnects, bursts of bad frames, the one-off faults (a killed worker,
a 10 MB prompt, an out-of-vocabulary token id), a watch on the scheduler process, and
the scheduler's state once the load has stopped."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from soak_load import (
    BAD_FRAME_KINDS,
    EXAMPLES,
    Ledger,
    Outcome,
    Samples,
    Spec,
    bad_frame,
    check_completion,
    percentile,
    rss_mb_and_fds,
)

from ipc.async_client import AsyncClient, ClientCompletion
from ipc.errors import ClientClosedError, ClientTimeoutError, ServerError, UnknownRequestError
from ipc.schema import ErrorCode, ErrorReply, HealthState, WorkerStatus, server_decoder
from scheduler_svc.launch import child_pids, cmdline
from shared.outputs import FinishReason
from shared.procinfo import process_start_time

SERVE_FLAGS = (
    "--num-gpu-blocks=256",
    "--num-cpu-blocks=256",
    "--max-num-seqs=32",
    "--max-num-batched-tokens=512",
    "--worker-timeout-s=2",
    "--client-timeout-s=5",
)
"""A KV pool below the peak working set of 32 requests of up to 264 tokens (preemption,
swap), chunked prefill, and quick detection of lost workers and vanished clients."""

OUT_OF_VOCAB = 10**9
BIG_PROMPT_CHARS = 10_000_000

DRAIN_S = 30.0
"""After the load stops, requests still open this long are lost."""
FINAL_WAIT_S = 30.0
"""How long the scheduler may take to reap the requests of closed clients."""
FRAME_REPLY_S = 5.0
BAD_FRAME_PERIOD_S = 2.0
SAMPLE_PERIOD_S = 2.0
CONTROL_TIMEOUT_S = 5.0
RECOVERY_LIMIT_S = 90.0
OVERRUN_S = 300.0
"""Slack on top of duration + drain + final wait before the whole run is called hung."""
CONTROL_ERRORS = (ClientTimeoutError, ServerError, ConnectionError)
"""What an inspect/health/ping call may fail with while the server is unwell
(ServerUnavailableError, a silent server, is a ConnectionError)."""


@dataclass
class Soak:
    address: str
    serve: subprocess.Popen[bytes]
    args: argparse.Namespace
    started: float = field(default_factory=time.monotonic)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    clients: list[AsyncClient] = field(default_factory=list)
    in_flight: Counter[AsyncClient] = field(default_factory=Counter)
    closed_by_us: set[AsyncClient] = field(default_factory=set)
    disconnects: list[int] = field(default_factory=list)
    """Requests in flight on each client closed by the script."""
    abort_calls: Counter[str] = field(default_factory=Counter)
    worker_lost: int = 0
    frames: dict[str, Counter[str]] = field(default_factory=dict)
    unanswered: list[str] = field(default_factory=list)
    scheduler_pid: int = 0
    died: str = ""
    """Why the server is gone ('' while it serves)."""
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.started)
        self.samples = Samples(min(max(10.0, 0.1 * self.args.duration), self.args.duration / 2))
        self.control = AsyncClient(self.address, timeout=CONTROL_TIMEOUT_S)

    def now(self) -> float:
        return time.monotonic() - self.started

    async def pause(self, seconds: float) -> bool:
        """Sleep; False (at once) if the load is stopped meanwhile."""
        try:
            await asyncio.wait_for(self.stop.wait(), max(0.0, seconds))
        except TimeoutError:
            return True
        return False

    def new_client(self) -> AsyncClient:
        return AsyncClient(self.address, timeout=self.args.request_timeout)

    # -- the run ---------------------------------------------------------------------------

    async def run(self) -> None:
        """The whole soak, bounded in time; ``soak.summarize`` then gathers the figures."""
        try:
            async with asyncio.timeout(
                self.args.duration + DRAIN_S + FINAL_WAIT_S + RECOVERY_LIMIT_S + OVERRUN_S
            ):
                await self._run()
        except TimeoutError:
            self.report["overran"] = True
        finally:
            await self._close(self.control)

    async def _run(self) -> None:
        schedulers = [p for p in child_pids(self.serve.pid) if " scheduler " in cmdline(p)]
        if not schedulers:
            self.died = "no scheduler process under serve"
            return
        self.scheduler_pid = schedulers[0]
        self.clients = [self.new_client() for _ in range(self.args.clients)]
        monitor = asyncio.create_task(self._monitor())
        lanes = [asyncio.create_task(self._lane(lane)) for lane in range(self.args.concurrency)]
        side = [
            asyncio.create_task(self._disconnects()),
            asyncio.create_task(self._bad_frames()),
            asyncio.create_task(self._kill_worker()),
            asyncio.create_task(self._big_prompt()),
            asyncio.create_task(self._out_of_vocab()),
        ]
        await self.pause(self.args.duration)
        self.stop.set()
        self.report["load_s"] = round(self.now(), 1)
        if self.died:  # nothing will answer: end what waits at once
            await asyncio.gather(*(self._close(c) for c in self.clients))
        _, pending = await asyncio.wait(lanes + side, timeout=DRAIN_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
        await asyncio.gather(*(self._close(c) for c in self.clients))
        if not self.died:
            await self._final_state()
        monitor.cancel()
        await asyncio.wait([monitor], timeout=5.0)
        if (sample := rss_mb_and_fds(self.scheduler_pid)) is not None:
            self.samples.add(self.now(), sample)

    async def _close(self, client: AsyncClient) -> None:
        try:
            await asyncio.wait_for(client.close(), 5.0)
        except TimeoutError:
            self.ledger.flag("slow close", "closing a client took over 5 s")

    async def _monitor(self) -> None:
        """Watch serve and the scheduler process; sample the scheduler's RSS and fds."""
        next_sample = 0.0
        while True:
            if self.serve.poll() is not None and not self.died:
                self.died = f"serve exited with status {self.serve.returncode}"
            elif process_start_time(self.scheduler_pid) is None and not self.died:
                self.died = "the scheduler process died"
            if self.died:
                self.report["server_died_at_s"] = round(self.now(), 1)
                self.stop.set()
                return
            if self.now() >= next_sample:
                if (sample := rss_mb_and_fds(self.scheduler_pid)) is not None:
                    self.samples.add(self.now(), sample)
                next_sample = self.now() + SAMPLE_PERIOD_S
            await asyncio.sleep(0.5)

    # -- load --------------------------------------------------------------------------------

    async def _lane(self, lane: int) -> None:
        rng = random.Random(f"{self.args.seed}-lane-{lane}")
        number = 0
        while not self.stop.is_set():
            number += 1
            await self._request(rng.choice(self.clients), Spec.draw(rng), f"soak-{lane}-{number}")

    async def _request(self, client: AsyncClient, spec: Spec, rid: str) -> None:
        record = self.ledger.open(spec.kind, rid)
        self.in_flight[client] += 1
        try:
            completion, aborted = await self._execute(client, spec, rid)
        except ServerError as error:
            self.worker_lost += error.code is ErrorCode.WORKER_LOST
            self.ledger.close(
                record, Outcome.REFUSED, str(error), code=error.code, unexpected=error.code
            )
        except ClientClosedError as error:
            if client in self.closed_by_us and not self.died:
                self.ledger.close(record, Outcome.DISCONNECTED)
            else:
                detail = f"{error!r} ({self.died or 'not closed by the script'})"
                self.ledger.close(record, Outcome.FAILED, detail, unexpected="ClientClosedError")
        except Exception as error:
            kind = type(error).__name__
            self.ledger.close(record, Outcome.FAILED, repr(error), unexpected=kind)
        else:
            if completion is None:  # left a stream early
                self.ledger.close(record, Outcome.ABORTED)
            elif any(sample.finish_reason is FinishReason.ABORT for sample in completion.samples):
                # An n>1 request aborted after some samples ended still reports sample 0's
                # own reason first: any aborted sample makes the request an aborted one.
                unexpected = "" if aborted else "aborted by the server"
                self.ledger.close(record, Outcome.ABORTED, unexpected, unexpected=unexpected)
            elif problem := check_completion(spec, completion):
                self.ledger.close(
                    record, Outcome.FAILED, problem, unexpected="inconsistent completion"
                )
            else:
                self.ledger.close(record, Outcome.COMPLETED)
        finally:
            self.in_flight[client] -= 1

    async def _execute(
        self, client: AsyncClient, spec: Spec, rid: str
    ) -> tuple[ClientCompletion | None, bool]:
        """Run one request: (its completion or None if left early, aborted by us)."""
        prompt = {"prompt": spec.prompt, "prompt_token_ids": spec.prompt_token_ids}
        if spec.kind == "generate":
            return await client.generate(**prompt, request_id=rid, sampling=spec.sampling), False
        if spec.kind == "abort_by_id":
            return await self._abort_by_id(client, spec, rid), True
        stream = client.stream(**prompt, request_id=rid, sampling=spec.sampling)
        deltas = 0
        async with stream:
            async for _ in stream:
                deltas += 1
                if spec.kind == "stream_break" and deltas >= spec.break_after:
                    return None, True  # leaving the block aborts it on the server
        return stream.completion, False

    async def _abort_by_id(self, client: AsyncClient, spec: Spec, rid: str) -> ClientCompletion:
        task = asyncio.ensure_future(
            client.generate(
                prompt=spec.prompt,
                prompt_token_ids=spec.prompt_token_ids,
                request_id=rid,
                sampling=spec.sampling,
            )
        )
        try:
            await asyncio.wait([task], timeout=spec.abort_after_s)
            if not task.done():
                try:
                    aborted = await client.abort(rid, timeout=CONTROL_TIMEOUT_S)
                    self.abort_calls["aborted" if aborted else "already_finished"] += 1
                except UnknownRequestError:
                    self.abort_calls["unknown"] += 1  # it finished meanwhile
                except ClientClosedError:
                    self.abort_calls["client_closed"] += 1
                except CONTROL_ERRORS as error:
                    self.abort_calls["failed"] += 1
                    self.ledger.flag(f"abort {type(error).__name__}", f"abort {rid}: {error!r}")
            return await task
        finally:
            if not task.done():
                task.cancel()

    async def _disconnects(self) -> None:
        """Now and then close a client with requests in flight and put a new one in its place."""
        rng = random.Random(f"{self.args.seed}-disconnects")
        period = max(3.0, self.args.duration / 20)
        while await self.pause(rng.uniform(0.5, 1.5) * period):
            busy = [i for i, c in enumerate(self.clients) if self.in_flight[c] > 0]
            if not busy:
                continue
            slot = rng.choice(busy)
            old = self.clients[slot]
            self.clients[slot] = self.new_client()
            self.closed_by_us.add(old)
            self.disconnects.append(self.in_flight[old])
            await self._close(old)

    # -- bad frames ---------------------------------------------------------------------------

    async def _bad_frames(self) -> None:
        rng = random.Random(f"{self.args.seed}-frames")
        context = zmq.asyncio.Context.instance()
        number = 0
        while await self.pause(BAD_FRAME_PERIOD_S):
            kinds = list(BAD_FRAME_KINDS)
            rng.shuffle(kinds)
            socket: zmq.asyncio.Socket | None = None
            for kind in kinds:
                if self.stop.is_set():
                    break
                if socket is None:
                    socket = context.socket(zmq.DEALER)
                    socket.setsockopt(zmq.LINGER, 0)
                    socket.connect(self.address)
                number += 1
                counts = self.frames.setdefault(kind, Counter())
                counts["sent"] += 1
                problem = await self._one_frame(socket, bad_frame(kind, rng, number))
                if problem:
                    if len(self.unanswered) < EXAMPLES:
                        self.unanswered.append(f"t={self.now():.1f}s {kind}: {problem}")
                    socket.close(linger=0)  # a late reply must not answer the next frame
                    socket = None
                else:
                    counts["answered"] += 1
            if socket is not None:
                socket.close(linger=0)

    async def _one_frame(self, socket: zmq.asyncio.Socket, parts: list[bytes]) -> str:
        """Send one bad message; '' if an ErrorReply came back in time, else what happened."""
        try:
            async with asyncio.timeout(FRAME_REPLY_S):
                await socket.send_multipart(parts)
                reply = await socket.recv()
        except TimeoutError:
            return f"no reply within {FRAME_REPLY_S:g} s"
        try:
            message = server_decoder.decode(reply)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return f"undecodable reply: {error}"
        if not isinstance(message, ErrorReply):
            return f"answered with {type(message).__name__}, not an ErrorReply"
        return ""

    # -- one-off events ----------------------------------------------------------------------

    async def _kill_worker(self) -> None:
        if not await self.pause(self.args.duration / 3):
            return
        workers = [p for p in child_pids(self.serve.pid) if " worker " in cmdline(p)]
        event: dict[str, Any] = {"killed_pid": None, "recovered": False, "recovery_s": None}
        self.report["worker_kill"] = event
        if not workers:
            event["error"] = "no worker process under serve"
            return
        killed = workers[0]
        try:
            os.kill(killed, signal.SIGKILL)
        except OSError as error:
            event["error"] = repr(error)
            return
        killed_at = time.monotonic()
        event.update(killed_pid=killed, at_s=round(self.now(), 1))
        while time.monotonic() - killed_at < RECOVERY_LIMIT_S and not self.died:
            try:
                info = await self.control.inspect()
                health = await self.control.health()
            except CONTROL_ERRORS as error:
                event["last_error"] = repr(error)
                await asyncio.sleep(0.2)
                continue
            ready = [
                w.pid for w in info.workers if w.state is WorkerStatus.READY and w.pid != killed
            ]
            if ready and health.status is HealthState.OK:
                event.update(
                    recovered=True,
                    recovery_s=round(time.monotonic() - killed_at, 2),
                    new_pid=ready[0],
                )
                return
            await asyncio.sleep(0.2)

    async def _big_prompt(self) -> None:
        if not await self.pause(self.args.duration / 2):
            return
        event: dict[str, Any] = {"chars": BIG_PROMPT_CHARS}
        self.report["big_prompt"] = event
        pings: list[float] = []
        done = asyncio.Event()
        prober = asyncio.create_task(self._probe(pings, done))
        begin = time.monotonic()
        event.update(
            await self._deliberate(
                "big_prompt", {"prompt": "a" * BIG_PROMPT_CHARS, "max_tokens": 1}, 60.0
            )
        )
        end = time.monotonic()
        await asyncio.sleep(1.0)
        done.set()
        await asyncio.wait([prober], timeout=CONTROL_TIMEOUT_S + 1)
        others = [
            r.ended_at - r.sent_at
            for r in self.ledger.records
            if r.outcome is Outcome.COMPLETED and begin <= r.ended_at <= end + 1.0
        ]
        event.update(
            max_ping_s=round(max(pings), 3) if pings else None,
            others_completed=len(others),
            others_p50_s=percentile(others, 50),
            others_max_s=max(others, default=None),
        )

    async def _probe(self, pings: list[float], done: asyncio.Event) -> None:
        """Ping round trips until ``done`` (a failed ping counts as the time it took)."""
        while not done.is_set():
            begin = time.monotonic()
            try:
                await self.control.ping()
            except CONTROL_ERRORS:
                pass
            pings.append(time.monotonic() - begin)
            await asyncio.sleep(0.1)

    async def _out_of_vocab(self) -> None:
        if not await self.pause(0.6 * self.args.duration):
            return
        self.report["out_of_vocab"] = await self._deliberate(
            "out_of_vocab", {"prompt_token_ids": [1, OUT_OF_VOCAB], "max_tokens": 4}, 30.0
        )

    async def _deliberate(
        self, kind: str, request: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        """Send a request that must be refused with bad_request, from a client of its own."""
        client = AsyncClient(self.address, timeout=timeout)
        rid = f"soak-{kind}"
        record = self.ledger.open(kind, rid)
        begin = time.monotonic()
        try:
            await client.generate(request_id=rid, **request)
            got = "completed"
            self.ledger.close(record, Outcome.COMPLETED, "", unexpected=f"{kind} {got}")
        except ServerError as error:
            got = error.code
            unexpected = "" if got == "bad_request" else f"{kind} {got}"
            detail = str(error)[:200]
            self.ledger.close(record, Outcome.REFUSED, detail, code=got, unexpected=unexpected)
        except Exception as error:
            got = type(error).__name__
            self.ledger.close(record, Outcome.FAILED, repr(error), unexpected=f"{kind} {got}")
        finally:
            await self._close(client)
        return {"outcome": got, "seconds": round(time.monotonic() - begin, 3)}

    # -- the end -----------------------------------------------------------------------------

    async def _final_state(self) -> None:
        """Wait (bounded) for the scheduler to hold nothing; report what it still holds."""
        deadline = time.monotonic() + FINAL_WAIT_S
        state: dict[str, Any] = {"snapshot": False}
        self.report["final_state"] = state
        while time.monotonic() < deadline and not self.died:
            try:
                reply = await self.control.inspect()
            except CONTROL_ERRORS as error:
                state["error"] = repr(error)
                await asyncio.sleep(0.5)
                continue
            snapshot = reply.snapshot
            if snapshot is None:
                await asyncio.sleep(0.5)
                continue
            gpu, cpu = snapshot.gpu_blocks, snapshot.cpu_blocks
            state.update(
                snapshot=True,
                requests_held=snapshot.num_running + snapshot.num_waiting + snapshot.num_swapped,
                seqs=len(snapshot.seqs),
                gpu_blocks_total=gpu.total,
                gpu_blocks_free=gpu.free,
                leaked_gpu_blocks=gpu.total - gpu.free,
                cpu_blocks_total=cpu.total,
                cpu_blocks_free=cpu.free,
                leaked_cpu_blocks=cpu.total - cpu.free,
                preemptions=dict(snapshot.preemptions),
                finished=dict(snapshot.finished),
                workers=[f"{w.rank}:{w.pid}:{w.state}" for w in reply.workers],
                settled_after_s=round(FINAL_WAIT_S - (deadline - time.monotonic()), 1),
            )
            state.pop("error", None)
            if not (state["requests_held"] or state["seqs"]):
                if not (state["leaked_gpu_blocks"] or state["leaked_cpu_blocks"]):
                    return
            await asyncio.sleep(0.5)
