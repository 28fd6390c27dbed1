"""The worker daemon: joins the scheduler, loads the model, runs every plan it gets.

Protocol (one DEALER socket): send WorkerJoin; receive WorkerSetup; load the model and
size the KV cache; send WorkerHello; then for each BatchPlan send its StepResult.
AttachSwapPool maps the scheduler's swap pool; Shutdown leaves with status 0. The model
load and every plan (decoded there too) run on one step thread, in the order they
arrived, while this thread only moves frames and sends heartbeats, so a slow load, a
long step or a huge plan is never mistaken for a dead worker. A plan that arrives while
another runs (overlapped scheduling) is queued to the step thread at once, which starts
it the moment the step before ends; this thread sends each result as it is done (a pipe
wakes it). Shutdown with ``restart`` (the scheduler gave up on this worker) exits 3,
which the supervisor and systemd restart. A worker that cannot serve sends WorkerError
and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import FrameType
from typing import Any

import msgspec
import zmq

from gpu_worker.group import join_group
from gpu_worker.model_runner import ModelRunner, resolve_device, use_device
from ipc.curve import client_curve_options, endpoint_needs_curve
from ipc.schema import (
    AttachSwapPool,
    Heartbeat,
    Shutdown,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerJoin,
    WorkerSetup,
    control_decoder,
    control_kind,
    encode,
    plan_decoder,
)
from shared.errors import ConfigError
from shared.procinfo import host_id, process_start_time
from shared.server_config import SUPERVISED_ENV
from shared.swap_pool import SwapPoolSegment

log = logging.getLogger("expeditor.worker")

RESTART_EXIT = 3
"""Exit status of a rank told to leave because its tensor-parallel group lost a member:
non-zero, so that systemd's Restart=on-failure starts it again (serve restarts any)."""

HEARTBEAT_S = 0.5
SETUP_TIMEOUT_S = 120.0


class WorkerDaemon:
    def __init__(
        self,
        rank: int,
        endpoint: str,
        device: str,
        *,
        curve_server_key: str = "",
        curve_client_key: str = "",
        cpu_threads: int = 0,
    ) -> None:
        keys: dict[str, bytes] = {}
        if curve_server_key and endpoint_needs_curve(endpoint):
            # The scheduler serves this endpoint with CURVE (see SchedulerDaemon._bind).
            if not curve_client_key:
                raise ConfigError(
                    f"curve_client_key: the worker endpoint {endpoint} needs CURVE: give this "
                    "worker a client key whose public key is in curve_authorized_clients",
                    field="curve_client_key",
                )
            keys = client_curve_options(curve_server_key, curve_client_key)
        self.rank = rank
        self.endpoint = endpoint
        self.device = resolve_device(device, rank)
        self.cpu_threads = cpu_threads
        if self.device.type == "cpu":
            # Load on all cores but one; the steps' count is chosen once the model is
            # loaded (gpu_worker.threads), on the step thread.
            import torch

            torch.set_num_threads(cpu_threads or max(1, (os.cpu_count() or 2) - 1))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.IDENTITY, f"worker-{rank}-{os.getpid()}".encode())
        if keys:
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys["curve_server_key"])
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys["curve_public_key"])
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys["curve_secret_key"])
        self.sock.connect(endpoint)
        self.runner: ModelRunner | None = None
        self.pool: SwapPoolSegment | None = None
        self.group_size = 1
        """Ranks of this worker's tensor-parallel group (1: a whole replica)."""
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        self.stop = False
        self.last_beat = 0.0
        self.done_r, self.done_w = os.pipe()
        """Written by the step thread when a task ends: wakes this thread's poll."""
        os.set_blocking(self.done_r, False)

    def _send(self, message: msgspec.Struct) -> None:
        self.sock.send(encode(message))  # type: ignore[arg-type]

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self.last_beat >= HEARTBEAT_S:
            self._send(Heartbeat(rank=self.rank))
            self.last_beat = now

    def _recv(self, timeout_s: float) -> object | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return control_decoder.decode(self.sock.recv())

    def _fail(self, message: str) -> int:
        log.error("rank %d cannot serve: %s", self.rank, message)
        self._send(WorkerError(rank=self.rank, message=message))
        return 1

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        # Under `expeditor serve`, Ctrl-C is the supervisor's: it stops the scheduler
        # first (which drains) and the workers after it.
        supervised = os.environ.get(SUPERVISED_ENV) == "1"
        signal.signal(signal.SIGINT, signal.SIG_IGN if supervised else self._on_signal)
        try:
            return self._serve()
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)
            if self.runner is not None:
                self.runner.kv_cache.detach_swap_pool()
            if self.pool is not None:
                self.pool.close()
            self.sock.close()
            self.ctx.term()
            os.close(self.done_r)
            os.close(self.done_w)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop = True

    def _serve(self) -> int:
        pid = os.getpid()
        self._send(
            WorkerJoin(
                rank=self.rank,
                pid=pid,
                device=str(self.device),
                host=host_id(),
                start_time=process_start_time(pid) or 0,
            )
        )
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        setup = None
        while setup is None:
            if self.stop:
                return 0
            if time.monotonic() > deadline:
                log.error("no setup from the scheduler at %s", self.endpoint)
                return 1
            message = self._recv(0.2)
            if isinstance(message, Shutdown):
                log.error("the scheduler refused this worker")
                return 1
            if isinstance(message, WorkerSetup):
                setup = message
        # Load on the step thread while this one keeps the heartbeats going: a model
        # that takes longer than the scheduler's worker_timeout_s to load is not lost.
        loading = self.executor.submit(self._setup, setup)
        while not loading.done():
            if self.stop:
                return 0
            self._beat()
            wait([loading], timeout=HEARTBEAT_S)
        try:
            hello = loading.result()
        except Exception as exc:  # loading can fail in many ways; all are fatal here
            return self._fail(f"{type(exc).__name__}: {exc}")
        self._send(hello)
        log.info(
            "rank %d ready on %s: %d KV blocks%s",
            self.rank,
            self.device,
            hello.num_gpu_blocks,
            f"; every layer windowed (kv_window {hello.kv_window}): blocks behind it go back"
            if hello.kv_window
            else f"; layer groups (kv_groups {hello.kv_groups}, blocks of "
            f"{hello.kv_block_layers[1]} of {hello.kv_block_layers[0]} layers): the windowed "
            "groups' blocks behind the window go back"
            if hello.kv_groups
            else "",
        )
        return self._serve_plans()

    def _serve_plans(self) -> int:
        """Queue every plan to the step thread as it arrives; send results in order."""
        pending: deque[Future[StepResult | None]] = deque()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.done_r, zmq.POLLIN)
        while not self.stop:
            self._beat()
            while pending and pending[0].done():
                try:
                    result = pending.popleft().result()
                except Exception as exc:
                    return self._fail(f"step failed: {type(exc).__name__}: {exc}")
                if result is not None:
                    self._send(result)
            # Wake when a frame or a finished step is ready, or in time for a heartbeat.
            events = dict(poller.poll(int(HEARTBEAT_S * 1000)))
            if self.done_r in events:
                try:
                    os.read(self.done_r, 4096)
                except BlockingIOError:
                    pass
            while self.sock.poll(0):
                frame = self.sock.recv()
                try:
                    # A plan is decoded (and its sampling parameters validated) on the
                    # step thread: however big, it never holds up the heartbeats.
                    if control_kind(frame) == "plan":
                        pending.append(self._queue(self._execute, frame))
                        continue
                    message = control_decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    return self._fail(f"malformed control frame: {exc}")
                if isinstance(message, AttachSwapPool):
                    pending.append(self._queue(self._attach, message.name))
                elif isinstance(message, Shutdown):
                    if message.restart:
                        log.warning("rank %d: its group lost a rank; leaving to restart", self.rank)
                        return RESTART_EXIT
                    log.info("rank %d: shutdown", self.rank)
                    return 0
        return 0

    def _execute(self, frame: bytes) -> StepResult | None:
        assert self.runner is not None
        return self.runner.execute(plan_decoder.decode(frame))

    def _queue(self, task: Callable[[Any], Any], arg: object) -> Future[Any]:
        """Run ``task(arg)`` on the step thread after what is queued there."""
        future = self.executor.submit(task, arg)
        future.add_done_callback(lambda _: os.write(self.done_w, b"."))
        return future

    def _setup(self, setup: WorkerSetup) -> WorkerHello:
        settings = setup.settings
        # This is the step thread (every step runs here): its current CUDA device must be
        # the worker's, or Triton launches on device 0.
        use_device(self.device)
        self.group_size = settings.server.tensor_parallel_size
        group = None
        if self.group_size > 1:
            group = join_group(
                self.rank,
                self.group_size,
                settings.server.dist_master_addr,
                settings.server.dist_master_port,
                self.device,
            )
        self.runner = ModelRunner(settings, device=self.device, group=group)
        log.info("rank %d: forward: %s", self.rank, self.runner.model_impl_note)
        log.info("rank %d: dtype %s", self.rank, self.runner.dtype_note)
        if setup.swap_pool:
            self._attach(setup.swap_pool)
        if self.device.type == "cpu" and self.group_size > 1:
            # Timing forwards would run collectives a different number of times on each
            # rank: split the cores instead.
            import torch

            threads = self.cpu_threads or max(1, (os.cpu_count() or 1) // self.group_size)
            torch.set_num_threads(threads)
            log.info("rank %d: %d torch threads (a core share of the group)", self.rank, threads)
        elif self.device.type == "cpu":
            from gpu_worker.threads import choose_cpu_threads

            choose_cpu_threads(self.runner, self.cpu_threads)
        return self.runner.hello(self.rank)

    def _attach(self, name: str) -> None:
        assert self.runner is not None
        if self.pool is not None:
            return
        self.pool = SwapPoolSegment.attach(name)
        ranks = self.group_size
        self.runner.kv_cache.attach_swap_pool(self.pool, self.rank if ranks > 1 else 0, ranks)


def run_worker(
    rank: int,
    endpoint: str,
    device: str,
    *,
    curve_server_key: str = "",
    curve_client_key: str = "",
    cpu_threads: int = 0,
) -> int:
    try:
        daemon = WorkerDaemon(
            rank,
            endpoint,
            device,
            curve_server_key=curve_server_key,
            curve_client_key=curve_client_key,
            cpu_threads=cpu_threads,
        )
    except ValueError as exc:  # ConfigError included
        log.error("%s", exc)
        return 2
    code = daemon.run()
    if daemon.group_size > 1:
        # A step thread may be stuck in a collective whose peer died: do not wait for it
        # at interpreter exit.
        logging.shutdown()
        os._exit(code)
    return code
