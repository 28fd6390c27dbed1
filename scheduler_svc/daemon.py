"""The scheduler daemon: the core behind a ZeroMQ frontend, driving worker processes.

Tasks on one (uv)loop:
- frontend: client frames in (Generate, Abort, Inspect, Health, Metrics, Ping),
  replies out, run by :class:`~scheduler_svc.frontend.Frontend`, which also owns the
  requests;
- backend: the workers' socket, run by :class:`RemoteExecutor` (joins, hellos,
  heartbeats, results, losses), with this daemon as its host;
- step loop: :meth:`StepEngine.step_async` (schedule -> the executor fans the plan
  out and collects the results -> update); it never waits on a client (sends are
  non-blocking);
- outputs: detokenize, stop strings, Delta / Finished, while the next step runs;
  each step's parts and its outputs' time go to one :class:`StepTimer` (inspect);
- housekeeping: lost workers, silent clients, the systemd watchdog.

The core, the swap pool and the step engine are built when the first worker says hello
(:func:`~scheduler_svc.engine_builder.build_engine`, as ``LLM`` builds them), and every
worker is set up with the same :class:`~shared.worker_settings.WorkerSettings`, the
worker half of the ``[server]`` and ``[scheduler]`` tables.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import Future
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from ipc.curve import CurveServer, endpoint_needs_curve
from ipc.schema import AttachSwapPool, ErrorCode, StepResult, WorkerHello, WorkerSetup
from scheduler_svc import sdnotify
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.engine_builder import build_engine
from scheduler_svc.frontend import Frontend
from scheduler_svc.kv_event_publisher import KVEventPublisher
from scheduler_svc.launch import free_port
from scheduler_svc.outputs import RequestEnded
from scheduler_svc.remote_executor import RemoteExecutor
from scheduler_svc.step_engine import StepEngine
from scheduler_svc.step_times import StepTimer
from scheduler_svc.workers import WorkerHandle, WorkerRegistry
from shared.config import SchedulerConfig
from shared.errors import ConfigError
from shared.server_config import SUPERVISED_ENV, ServerConfig
from shared.swap_pool import SwapPoolSegment, remove_stale_segments
from shared.tokenizer import load_tokenizer
from shared.worker_settings import WorkerSettings

log = logging.getLogger("expeditor.scheduler")


class SchedulerDaemon:
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
        frontend_socket = self._bind(
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
        self.registry = WorkerRegistry(server.num_ranks, server.worker_timeout_s)
        self.executor = RemoteExecutor(
            self.backend,
            self.registry,
            self,
            step_timeout_s=server.step_timeout_s,
            group=server.tensor_parallel_size > 1,
        )
        self.dist_port = server.dist_master_port or (
            free_port(server.dist_master_addr) if server.tensor_parallel_size > 1 else 0
        )
        """The tensor-parallel group's rendezvous port (0 in the config: one picked here,
        for ranks on this machine, as under serve)."""
        self.core: Scheduler | None = None
        self.engine: StepEngine | None = None
        """The core and the workers, once the first worker said hello."""
        self.swap_pool: SwapPoolSegment | None = None
        self.events: asyncio.Queue[StepOutput | RequestEnded] = asyncio.Queue()
        """What the output task sends: each step's output, requests ended outside a step."""
        self.wake = asyncio.Event()
        self.step_times = StepTimer()
        self.frontend = Frontend(
            frontend_socket,
            server,
            config,
            self.registry,
            self.events,
            self.wake,
            self._stop_seq,
            step_times=self.step_times,
        )
        self.kv_events = (
            KVEventPublisher(
                self.ctx,
                server.kv_events_endpoint,
                topic=server.kv_events_topic,
                replay_endpoint=server.kv_events_replay_endpoint,
                buffer_steps=server.kv_events_buffer_steps,
                data_parallel_rank=server.data_parallel_rank,
                connect=server.kv_events_connect,
            )
            if server.kv_events_endpoint
            else None
        )
        """The prefix cache's KV events, when published (bound before any core exists,
        so routers may subscribe early)."""
        self.stop_event = asyncio.Event()
        self.signals = 0
        self.drain_cut = asyncio.Event()
        self.loop_alive = time.monotonic()
        self.short_since: float | None = self.loop_alive

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
                ("frontend", self.frontend.run()),
                ("backend", self.executor.run()),
                ("steps", self._step_loop()),
                ("outputs", self._output_loop()),
                ("housekeeping", self._housekeeping_loop()),
                *(
                    [("kv-event-replay", self.kv_events.serve_replay())]
                    if self.kv_events is not None and self.kv_events.replay is not None
                    else []
                ),
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
        self.frontend.stopping = True
        sdnotify.stopping()
        timeout = self.server.shutdown_timeout_s
        requests = self.frontend.outputs.requests
        log.info("draining: %d requests in flight, up to %g s", len(requests), timeout)
        deadline = time.monotonic() + timeout
        while requests and not self.drain_cut.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, _ = await asyncio.wait(tasks, timeout=min(left, 0.05))
            if done:
                return done
        return set()

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        self.frontend.stopping = True
        sdnotify.stopping()
        outputs = self.frontend.outputs
        while not self.events.empty():  # what the output task had not sent yet
            outputs.handle(self.events.get_nowait())
        if outputs.requests:
            log.warning("stopping with %d requests unfinished", len(outputs.requests))
        for request_id in list(outputs.requests):
            outputs.fail(
                request_id,
                ErrorCode.SHUTTING_DOWN,
                "the server stopped before this request finished "
                f"(shutdown_timeout_s={self.server.shutdown_timeout_s:g})",
            )
        self.executor.shutdown()
        await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.frontend.socket.close(linger=1000)  # let the last replies out
        self.backend.close(linger=0)
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()
        if self.swap_pool is not None:
            self.swap_pool.close()

    # -- workers (the executor's host) ---------------------------------------------------

    def worker_setup(self) -> WorkerSetup:
        """The [server] and [scheduler] settings every worker runs by: the core's once it
        exists (its cache size is the first worker's), with the group's rendezvous port."""
        config = self.core.config if self.core is not None else self.config
        server = msgspec.structs.replace(self.server, dist_master_port=self.dist_port)
        return WorkerSetup(
            settings=WorkerSettings(server=server, scheduler=config),
            swap_pool=self.swap_pool.name if self.swap_pool else None,
        )

    def accept_hello(self, handle: WorkerHandle, hello: WorkerHello) -> str | None:
        """The first hello sizes the core; later ones must match it."""
        if hello.block_size != self.config.block_size:
            return f"block_size {hello.block_size}"
        if hello.tensor_parallel_size != self.server.tensor_parallel_size:
            return f"a tensor-parallel group of {hello.tensor_parallel_size}"
        if self.core is None:
            self._create_core(hello)
            for other in self.registry.workers.values():
                if other is not handle and self.swap_pool is not None:
                    self.executor.send(other, AttachSwapPool(name=self.swap_pool.name))
        else:
            assert self.core.config.num_gpu_blocks is not None
            if hello.num_gpu_blocks < self.core.config.num_gpu_blocks:
                return f"only {hello.num_gpu_blocks} KV blocks"
            if hello.kv_bytes_per_block != self.core.cost_model.kv_bytes_per_block:
                return "a different KV block size in bytes"
            if (hello.vocab_size or None) != self.core.vocab_size:
                return f"a vocabulary of {hello.vocab_size}"
        if self.swap_pool is not None and handle.hello is None:
            self.executor.send(handle, AttachSwapPool(name=self.swap_pool.name))
        self.wake.set()
        return None

    def worker_lost_idle(self) -> None:
        if self.engine is not None:
            self._quarantine(self.engine.on_worker_lost())
            self._publish_kv_events()

    def steps_in_flight(self) -> list[Future[StepResult]]:
        return self.engine.futures() if self.engine is not None else []

    def _create_core(self, hello: WorkerHello) -> None:
        built = build_engine(self.config, hello, self.executor, times=self.step_times)
        self.core, self.engine, self.swap_pool = built.core, built.engine, built.swap_pool
        self.frontend.attach(self.core, hello.model, load_tokenizer(hello.model))
        self.frontend.build_grammars()  # ~0.5 s on a thread, before any request needs it
        if self.kv_events is not None:
            self.core.kv.record_events()
            self._publish_kv_events()  # AllBlocksCleared: a subscriber starts from nothing

    def _publish_kv_events(self) -> None:
        """Send what the prefix cache stored and forgot since the last call."""
        if self.kv_events is not None and self.core is not None and self.core.kv.events is not None:
            self.kv_events.publish(self.core.kv.events)

    # -- the step loop -------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            self.loop_alive = time.monotonic()
            engine = self.engine
            # Steps in flight are always collected (a lost one re-queues its requests).
            if engine is None or not (
                engine.core.inflight or (self.executor.serving() and engine.has_work())
            ):
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                continue
            output = await engine.step_async()
            self._publish_kv_events()
            if output.lost:  # re-queued, unless quarantined
                self._quarantine(output.quarantined)
            else:
                self.events.put_nowait(output)

    def _quarantine(self, requests: list[Request]) -> None:
        """Requests in two steps that workers died in: failed, never re-queued."""
        for request in requests:
            log.error("request %s quarantined: workers died running it", request.request_id)
            self.frontend.end_request(
                request.request_id,
                ErrorCode.QUARANTINED,
                f"workers failed in {request.num_failed_steps} steps that ran this request; "
                "it is not retried",
            )

    def _stop_seq(self, seq_id: str) -> str | None:
        return self.engine.stop_seq(seq_id) if self.engine is not None else None

    async def _output_loop(self) -> None:
        outputs, times = self.frontend.outputs, self.step_times
        while True:
            item = await self.events.get()
            if isinstance(item, StepOutput):
                started = time.perf_counter()
                outputs.on_step(item)
                times.add_outputs(time.perf_counter() - started)
            else:
                outputs.handle(item)

    # -- housekeeping --------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        interval = sdnotify.watchdog_interval()
        last_ping = 0.0
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            self.executor.check(now)
            self._check_worker_wait(now)
            self.frontend.check_clients(now)
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
        for request_id in list(self.frontend.outputs.requests):
            self.frontend.end_request(request_id, ErrorCode.WORKER_LOST, message)


def run_scheduler(server: ServerConfig, config: SchedulerConfig) -> int:
    """Run the daemon until SIGINT/SIGTERM; the exit status for the process."""

    # The output task decodes each step's windows in one decode_batch call; the Rust
    # tokenizer's thread pool would spread it over every core, where the workers run
    # (measured on 2 cores: 3.0 ms of output processing per step with it, 0.8 without).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    async def main() -> int:
        daemon = SchedulerDaemon(server, config)
        return await daemon.run()

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main())
    return uvloop.run(main())
