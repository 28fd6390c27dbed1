"""The scheduler daemon: the core behind a ZeroMQ frontend, driving worker processes.

Tasks on one (uv)loop:
- frontend: client frames in (Generate, Abort, Inspect, Health, Ping), replies out;
- backend: worker frames in (join, hello, heartbeats, step results);
- step loop: schedule -> send the plan to every worker -> await their results ->
  update; it never waits on a client (sends are non-blocking);
- outputs: detokenize, stop strings, Delta / Finished, while the next step runs;
- housekeeping: lost workers, silent clients, the systemd watchdog.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from ipc.curve import CurveServer, endpoint_needs_curve
from ipc.schema import (
    AttachSwapPool,
    Generate,
    Heartbeat,
    NewSeq,
    Shutdown,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerJoin,
    WorkerSetup,
    encode,
    worker_decoder,
)
from scheduler_svc.detokenizer import load_tokenizer
from scheduler_svc.frontend import FrontendMixin
from scheduler_svc.outputs import ClientRequest, OutputProcessor, StepEvents
from scheduler_svc.scheduler import Scheduler, UpdateOutcome
from scheduler_svc.workers import WorkerHandle, WorkerRegistry
from shared import sdnotify
from shared.config import SchedulerConfig
from shared.errors import ConfigError
from shared.server_config import SUPERVISED_ENV, ServerConfig
from shared.swap_pool import SwapPoolSegment, remove_stale_segments

log = logging.getLogger("expeditor.scheduler")


class WorkerLostError(RuntimeError):
    pass


@dataclass(slots=True)
class _Inflight:
    step: int
    pending: set[bytes]
    results: dict[int, StepResult] = field(default_factory=dict)
    future: asyncio.Future[StepResult] | None = None


def _model_max_len(model_dir: str) -> int | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) else None


class SchedulerDaemon(FrontendMixin):
    def __init__(self, server: ServerConfig, config: SchedulerConfig) -> None:
        if not server.frontend or not server.worker_endpoint:
            raise ConfigError("the scheduler needs frontend and worker_endpoint addresses")
        remove_stale_segments()  # swap segments of schedulers that died uncleanly (logged)
        self.server = server
        self.config = config
        # Whatever umask the daemon was started with (000 included), the files it makes
        # (socket files, their directories, the swap segment) are for its own user only:
        # a client that can open the frontend socket can submit, inspect and abort.
        os.umask(0o077)
        self.ctx = zmq.asyncio.Context()
        # The ZAP handler runs before any bind: a CURVE handshake without one is admitted.
        self.curve = (
            CurveServer(self.ctx, server.curve_server_key, server.curve_authorized_clients)
            if server.curve
            else None
        )
        # A client frame above max_frame_bytes never reaches the decoder: ZeroMQ drops
        # the connection that sent it.
        self.frontend = self._bind(
            server.frontend, curve=server.curve, max_frame_bytes=server.max_frame_bytes
        )
        self.backend = self._bind(
            server.worker_endpoint,
            curve=server.curve and endpoint_needs_curve(server.worker_endpoint),
        )
        if server.insecure_tcp and not server.curve:
            for address in (server.frontend, server.worker_endpoint):
                if address.startswith("tcp://"):
                    log.warning(
                        "insecure_tcp: %s has no authentication: ANY local user can submit, "
                        "inspect and abort requests",
                        address,
                    )
        self.registry = WorkerRegistry(server.workers, server.worker_timeout_s)
        self.core: Scheduler | None = None
        self.outputs = OutputProcessor(None, self._send, self._stop_seq)
        self.model = server.model
        self.swap_pool: SwapPoolSegment | None = None
        self.backlog: list[tuple[ClientRequest, Generate]] = []
        """Requests that arrived before the first worker registered (no tokenizer yet)."""
        self.tokenizing: set[asyncio.Task[None]] = set()
        self.clients: dict[bytes, float] = {}
        self.events: asyncio.Queue[StepEvents | tuple[str, str, str, str]] = asyncio.Queue()
        self.wake = asyncio.Event()
        self.stop_event = asyncio.Event()
        self.signals = 0
        self.drain_cut = asyncio.Event()
        self.inflight: _Inflight | None = None
        self.started = time.monotonic()
        self.loop_alive = self.started
        self.short_since: float | None = self.started
        self.stopping = False

    def _bind(self, address: str, *, curve: bool, max_frame_bytes: int = -1) -> zmq.asyncio.Socket:
        """A ROUTER bound to ``address``; a CURVE server if ``curve``. An ipc:// socket
        file is owner-only (0600), in a directory created 0700 if missing."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if curve:
            assert self.curve is not None
            self.curve.secure(sock)
        path = Path(address[len("ipc://") :]) if address.startswith("ipc://") else None
        if path is not None and str(path).startswith("@"):
            path = None  # abstract namespace: no file
        try:
            if path is not None:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            sock.bind(address)
            if path is not None:
                path.chmod(0o600)
        except (OSError, zmq.ZMQError) as exc:
            sock.close()
            raise ConfigError(f"cannot bind {address}: {exc}") from None
        return sock

    # -- sending ---------------------------------------------------------------------------

    def _send_worker(self, handle: WorkerHandle, message: msgspec.Struct) -> None:
        self.backend.send_multipart([handle.identity, encode(message)])  # type: ignore[arg-type]

    # -- run -------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # Under `expeditor serve` a terminal's Ctrl-C reaches every process of the group:
        # the supervisor turns it into an ordered SIGTERM, so the scheduler ignores it.
        supervised = os.environ.get(SUPERVISED_ENV) == "1"
        for sig in (signal.SIGTERM,) if supervised else (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        if supervised:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        tasks = [
            asyncio.create_task(coro, name=name)
            for name, coro in (
                ("frontend", self._frontend_loop()),
                ("backend", self._backend_loop()),
                ("steps", self._step_loop()),
                ("outputs", self._output_loop()),
                ("housekeeping", self._housekeeping_loop()),
            )
        ]
        log.info("serving on %s, workers on %s", self.server.frontend, self.server.worker_endpoint)
        sdnotify.ready(f"serving on {self.server.frontend}")
        stop = asyncio.create_task(self.stop_event.wait())
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if stop in done:
            done = await self._drain(tasks)
        failed = [t for t in done if t is not stop and t.exception() is not None]
        await self._shutdown(tasks)
        if failed:
            exc = failed[0].exception()
            log.error("task %s failed: %r", failed[0].get_name(), exc)
            return 1
        return 0

    def _on_signal(self) -> None:
        """The first SIGTERM starts a drain; a second one ends it at once."""
        self.signals += 1
        self.stop_event.set()
        if self.signals > 1:
            self.drain_cut.set()

    async def _drain(self, tasks: list[asyncio.Task[None]]) -> set[asyncio.Task[None]]:
        """Refuse new requests (``shutting_down``) and let those in flight finish, for up
        to ``shutdown_timeout_s``; returns the tasks that ended meanwhile (failed ones)."""
        self.stopping = True
        sdnotify.stopping()
        timeout = self.server.shutdown_timeout_s
        log.info("draining: %d requests in flight, up to %g s", len(self.outputs.requests), timeout)
        deadline = time.monotonic() + timeout
        while self.outputs.requests and not self.drain_cut.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, _ = await asyncio.wait(tasks, timeout=min(left, 0.05))
            if done:
                return done
        return set()

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        self.stopping = True
        sdnotify.stopping()
        while not self.events.empty():  # what the output task had not sent yet
            self._output(self.events.get_nowait())
        if self.outputs.requests:
            log.warning("stopping with %d requests unfinished", len(self.outputs.requests))
        for request_id in list(self.outputs.requests):
            self.outputs.fail(
                request_id,
                "shutting_down",
                "the server stopped before this request finished "
                f"(shutdown_timeout_s={self.server.shutdown_timeout_s:g})",
            )
        for handle in list(self.registry.workers.values()):
            self._send_worker(handle, Shutdown())
        await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.frontend.close(linger=1000)  # let the last replies out
        self.backend.close(linger=0)
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()
        if self.swap_pool is not None:
            self.swap_pool.close()

    # -- workers ---------------------------------------------------------------------------

    async def _backend_loop(self) -> None:
        while True:
            frames = await self.backend.recv_multipart()
            if len(frames) != 2:
                continue
            identity, payload = frames
            try:
                message = worker_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("malformed worker frame: %s", exc)
                continue
            handle = self.registry.get(identity)
            if handle is not None:
                handle.last_seen = time.monotonic()
            if isinstance(message, WorkerJoin):
                self._on_join(identity, message)
            elif handle is None:
                continue  # a frame from a worker already declared lost
            elif isinstance(message, WorkerHello):
                self._on_hello(handle, message)
            elif isinstance(message, StepResult):
                self._on_result(handle, message)
            elif isinstance(message, WorkerError):
                log.error("worker rank %d: %s", message.rank, message.message)
                self._lose(handle.identity)
            elif isinstance(message, Heartbeat):
                pass

    def _on_join(self, identity: bytes, join: WorkerJoin) -> None:
        try:
            handle, replaced = self.registry.join(identity, join, time.monotonic())
        except ValueError as exc:
            log.error("refusing worker pid %d: %s", join.pid, exc)
            self.backend.send_multipart([identity, encode(Shutdown())])
            return
        if replaced is not None:
            self._on_lost(replaced)
        log.info("worker rank %d (pid %d, %s) joined", join.rank, join.pid, join.device)
        blocks = self.core.config.num_gpu_blocks if self.core else self.config.num_gpu_blocks
        self._send_worker(
            handle,
            WorkerSetup(
                model=self.server.model,
                block_size=self.config.block_size,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                num_gpu_blocks=blocks,
                gpu_memory_utilization=self.server.gpu_memory_utilization,
                swap_pool=self.swap_pool.name if self.swap_pool else None,
            ),
        )

    def _on_hello(self, handle: WorkerHandle, hello: WorkerHello) -> None:
        if hello.block_size != self.config.block_size:
            return self._reject_worker(handle, f"block_size {hello.block_size}")
        if self.core is None:
            self._create_core(hello)
            for other in self.registry.workers.values():
                if other is not handle and self.swap_pool is not None:
                    self._send_worker(other, AttachSwapPool(name=self.swap_pool.name))
        else:
            assert self.core.config.num_gpu_blocks is not None
            if hello.num_gpu_blocks < self.core.config.num_gpu_blocks:
                return self._reject_worker(handle, f"only {hello.num_gpu_blocks} KV blocks")
            if hello.kv_bytes_per_block != self.core.cost_model.kv_bytes_per_block:
                return self._reject_worker(handle, "a different KV block size in bytes")
            if (hello.vocab_size or None) != self.core.vocab_size:
                return self._reject_worker(handle, f"a vocabulary of {hello.vocab_size}")
        if self.swap_pool is not None and handle.hello is None:
            self._send_worker(handle, AttachSwapPool(name=self.swap_pool.name))
        self.registry.mark_ready(handle, hello)
        log.info("worker rank %d ready: %d KV blocks", hello.rank, hello.num_gpu_blocks)
        self.wake.set()
        return None

    def _reject_worker(self, handle: WorkerHandle, why: str) -> None:
        log.error("worker rank %d does not match this server: %s", handle.rank, why)
        self._send_worker(handle, Shutdown())
        self.registry.drop(handle.identity)

    def _create_core(self, hello: WorkerHello) -> None:
        self.model = hello.model
        max_len = _model_max_len(hello.model) or self.config.max_model_len
        config = msgspec.structs.replace(
            self.config,
            num_gpu_blocks=hello.num_gpu_blocks,
            max_model_len=min(self.config.max_model_len, max_len),
        )
        if config.num_cpu_blocks:
            self.swap_pool = SwapPoolSegment.create(config.num_cpu_blocks, hello.kv_bytes_per_block)
        self.outputs.tokenizer = load_tokenizer(hello.model)
        self.core = Scheduler(
            config,
            eos_token_ids=hello.eos_token_ids,
            kv_bytes_per_block=hello.kv_bytes_per_block,
            vocab_size=hello.vocab_size or None,
        )
        backlog, self.backlog = self.backlog, []
        for request, msg in backlog:
            self._submit(request, msg)

    def _on_result(self, handle: WorkerHandle, result: StepResult) -> None:
        inflight = self.inflight
        if (
            inflight is None
            or result.step != inflight.step
            or handle.identity not in inflight.pending
        ):
            return
        inflight.pending.discard(handle.identity)
        inflight.results[handle.rank] = result
        if not inflight.pending and inflight.future is not None and not inflight.future.done():
            inflight.future.set_result(inflight.results[min(inflight.results)])

    def _kill_hung(self, inflight: _Inflight) -> None:
        """Workers that still owe a step after step_timeout_s are hung (a stuck kernel
        keeps heartbeats going): kill them, so serve or systemd starts fresh ones."""
        for identity in list(inflight.pending):
            handle = self.registry.drop(identity)
            if handle is None:
                continue
            log.error(
                "worker rank %d (pid %d) did not finish step %d in %g s: killing it",
                handle.rank,
                handle.pid,
                inflight.step,
                self.server.step_timeout_s,
            )
            try:
                os.kill(handle.pid, signal.SIGKILL)
            except OSError as exc:  # gone already, or not ours to kill
                log.warning("could not kill pid %d: %s", handle.pid, exc)

    def _lose(self, identity: bytes) -> None:
        handle = self.registry.drop(identity)
        if handle is not None:
            self._on_lost(handle)

    def _on_lost(self, handle: WorkerHandle) -> None:
        """The device cache of a dropped worker is gone: fail the step in flight (the
        step loop then re-queues), or re-queue now if idle."""
        log.error("worker rank %d (pid %d) lost", handle.rank, handle.pid)
        if self.inflight is not None and self.inflight.future is not None:
            if not self.inflight.future.done():
                self.inflight.future.set_exception(WorkerLostError(f"rank {handle.rank}"))
        elif self.core is not None:
            self.core.on_worker_lost()

    # -- the step loop -------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.loop_alive = time.monotonic()
            core = self.core
            ready = self.registry.ready()
            if core is None or len(ready) < self.registry.expected or not core.has_work():
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                continue
            plan = core.schedule()
            inflight = _Inflight(
                plan.step, {w.identity for w in ready}, future=loop.create_future()
            )
            self.inflight = inflight
            payload = encode(plan)
            for handle in ready:
                await self.backend.send_multipart([handle.identity, payload])
            try:
                assert inflight.future is not None
                result = await asyncio.wait_for(
                    asyncio.shield(inflight.future), timeout=self.server.step_timeout_s
                )
            except TimeoutError:
                self._kill_hung(inflight)
                self._step_failed(core)
                continue
            except WorkerLostError:
                self._step_failed(core)
                continue
            self.inflight = None
            outcome = core.update(result)
            self.events.put_nowait(self._capture(plan.new_seqs, outcome))

    def _step_failed(self, core: Scheduler) -> None:
        """A worker died (or hung) inside the step in flight: re-queue its requests, and
        fail those already in a step that failed before (quarantined)."""
        self.inflight = None
        for request in core.on_worker_lost():
            log.error("request %s quarantined: workers died running it", request.request_id)
            self._end_request(
                request.request_id,
                "quarantined",
                f"workers failed in {request.num_failed_steps} steps that ran this request; "
                "it is not retried",
            )

    def _capture(self, new_seqs: list[NewSeq], outcome: UpdateOutcome) -> StepEvents:
        return StepEvents(
            tokens=[
                (s.request.request_id, s.sample_index, s.seq_id, s.token_ids[-1])
                for s in outcome.advanced
            ],
            finished_seqs=[
                (s.request.request_id, s.sample_index, str(s.finish_reason))
                for s in outcome.finished
            ],
            finished_requests=[r.request_id for r in outcome.finished_requests],
            logprobs=outcome.logprobs,
            scheduled_requests=[n.request_id for n in new_seqs],
            time=time.monotonic(),
        )

    async def _output_loop(self) -> None:
        while True:
            self._output(await self.events.get())

    def _output(self, item: StepEvents | tuple[str, str, str, str]) -> None:
        if isinstance(item, StepEvents):
            self.outputs.on_step(item)
        elif item[0] == "finish":
            self.outputs.finish(item[1], item[2])
        else:
            self.outputs.fail(item[1], item[2], item[3])

    # -- housekeeping --------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        interval = sdnotify.watchdog_interval()
        last_ping = 0.0
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for handle in self.registry.expire(now):
                self._on_lost(handle)
            self._check_worker_wait(now)
            self._check_clients(now)
            if interval and now - last_ping >= interval and now - self.loop_alive < 2 * interval:
                sdnotify.watchdog()
                last_ping = now

    def _check_worker_wait(self, now: float) -> None:
        if len(self.registry.ready()) >= self.registry.expected:
            self.short_since = None
            return
        if self.short_since is None:
            self.short_since = now
        if now - self.short_since < self.server.worker_wait_s:
            return
        message = f"no worker for {self.server.worker_wait_s:g} s"
        for request_id in list(self.outputs.requests):
            self._end_request(request_id, "worker_lost", message)

    def _check_clients(self, now: float) -> None:
        silent = {
            c for c, seen in self.clients.items() if now - seen > self.server.client_timeout_s
        }
        if not silent:
            return
        for request_id, request in list(self.outputs.requests.items()):
            if request.client in silent:
                log.info("client went silent: aborting %s", request_id)
                self._end_request(request_id)
        for client in silent:
            del self.clients[client]


def run_scheduler(server: ServerConfig, config: SchedulerConfig) -> int:
    """Run the daemon until SIGINT/SIGTERM; the exit status for the process."""

    async def main() -> int:
        daemon = SchedulerDaemon(server, config)
        return await daemon.run()

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main())
    return uvloop.run(main())
