"""Worker processes as an :class:`~scheduler_svc.step_engine.Executor`, over ZeroMQ.

The scheduler daemon's worker endpoint is a ROUTER socket; each worker a DEALER. This
module owns everything on that socket: joins (answered with the setup the host
chooses), hellos (accepted or refused by the host), heartbeats, the fan-out of each
plan to every ready rank and the collection of their results (rank 0's samples are
used), and losses: a worker that says it failed, goes silent, dies (seen by its pid
when it runs in this pid namespace), or owes a step for ``step_timeout_s`` (hung) is
dropped, told to leave and, when it runs in this pid namespace, killed, so that its
supervisor or systemd replaces it.

Several plans may be in flight (overlapped scheduling): a worker runs them in order, so
a step's timeout counts from when the step before it ended. The executor keeps no list
of them: the future it returns for a plan (a :class:`_SentStep`) carries the ranks that
still owe its result, the results in so far and its timer, and the steps in flight are
asked of the host (``steps_in_flight``: the step engine's, whose core owns the one
queue). A loss during a step fails the futures of the steps still owed with
:class:`~scheduler_svc.step_engine.StepLostError`, and the engine then clears the queue;
a loss while nothing is owed is reported to the host, which has the engine clear it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import Future
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from ipc.schema import (
    BatchPlan,
    Heartbeat,
    Shutdown,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerJoin,
    WorkerSetup,
    encode,
    worker_decoder,
)
from scheduler_svc.step_engine import StepLostError
from scheduler_svc.workers import WorkerHandle, WorkerRegistry
from shared.procinfo import process_alive

log = logging.getLogger("expeditor.scheduler")


class WorkerHost(Protocol):
    """What the daemon decides about its workers."""

    def worker_setup(self) -> WorkerSetup:
        """What a joining worker must load."""
        ...

    def accept_hello(self, handle: WorkerHandle, hello: WorkerHello) -> str | None:
        """Take a worker's hello; the reason it does not fit, or None to accept it."""
        ...

    def worker_lost_idle(self) -> None:
        """A worker was lost while no step was owed."""
        ...

    def steps_in_flight(self) -> list[Future[StepResult]]:
        """The futures of the steps in flight, oldest first (``StepEngine.futures``)."""
        ...


class _SentStep(Future[StepResult]):
    """A plan sent to the ranks, as the future of its result."""

    def __init__(self, step: int, pending: set[bytes]) -> None:
        super().__init__()
        self.step = step
        self.pending = pending
        """The ranks (identities) that still owe the result."""
        self.results: dict[int, StepResult] = {}
        """Rank -> its result, so far."""
        self.timer: asyncio.TimerHandle | None = None


class RemoteExecutor:
    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        registry: WorkerRegistry,
        host: WorkerHost,
        *,
        step_timeout_s: float,
        group: bool = False,
    ) -> None:
        """``group``: the ranks are one tensor-parallel group, which cannot lose a member:
        losing one takes the others down too (their supervisor restarts them all)."""
        self.socket = socket
        self.registry = registry
        self.host = host
        self.step_timeout_s = step_timeout_s
        self.group = group

    # -- the executor ----------------------------------------------------------------------

    def serving(self) -> bool:
        """Every expected rank is ready."""
        return len(self.registry.ready()) >= self.registry.expected

    def submit(self, plan: BatchPlan) -> Future[StepResult]:
        """Send ``plan`` to every ready rank (call on the daemon's loop)."""
        ready = self.registry.ready()
        if not ready:
            future: Future[StepResult] = Future()
            future.set_exception(StepLostError("no worker is ready"))
            return future
        sent = _SentStep(plan.step, {w.identity for w in ready})
        if not self._owed():
            self._arm(sent)  # nothing ahead of it: it runs now
        payload = encode(plan)
        for handle in ready:
            self._send_raw(handle.identity, payload)
        return sent

    def _owed(self) -> list[_SentStep]:
        """The steps in flight whose results are not all in, oldest first (a plan being
        submitted is not among them yet)."""
        return [
            step
            for step in self.host.steps_in_flight()
            if isinstance(step, _SentStep) and not step.done()
        ]

    def send(self, handle: WorkerHandle, message: msgspec.Struct) -> None:
        self._send_raw(handle.identity, encode(message))  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Tell every worker to leave."""
        for handle in list(self.registry.workers.values()):
            self.send(handle, Shutdown())

    def check(self, now: float) -> None:
        """Drop workers silent for too long or seen dead (call now and then). Frames
        waiting to be read mean this loop, not the workers, was slow: they are read
        first, so a stalled scheduler never takes its own delay for a silent worker."""
        if self.socket.get(zmq.EVENTS) & zmq.POLLIN:
            return
        for handle in self.registry.expire(now):
            self._on_lost(handle)

    def _send_raw(self, identity: bytes, payload: bytes) -> None:
        sent = self.socket.send_multipart([identity, payload])
        if isinstance(sent, asyncio.Future):
            sent.add_done_callback(_log_send_failure)

    # -- worker frames -----------------------------------------------------------------------

    async def run(self) -> None:
        """Receive worker frames until cancelled (a daemon task)."""
        while True:
            frames = await self.socket.recv_multipart()
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
            self._send_raw(identity, encode(Shutdown()))
            return
        if replaced is not None:
            self._on_lost(replaced)
        log.info("worker rank %d (pid %d, %s) joined", join.rank, join.pid, join.device)
        self.send(handle, self.host.worker_setup())

    def _on_hello(self, handle: WorkerHandle, hello: WorkerHello) -> None:
        refusal = self.host.accept_hello(handle, hello)
        if refusal is not None:
            log.error("worker rank %d does not match this server: %s", handle.rank, refusal)
            self.send(handle, Shutdown())
            self.registry.drop(handle.identity)
            return
        self.registry.mark_ready(handle, hello)
        log.info("worker rank %d ready: %d KV blocks", hello.rank, hello.num_gpu_blocks)

    def _on_result(self, handle: WorkerHandle, result: StepResult) -> None:
        sent = next((step for step in self._owed() if step.step == result.step), None)
        if sent is None or handle.identity not in sent.pending:
            return
        sent.pending.discard(handle.identity)
        sent.results[handle.rank] = result
        if not sent.pending:
            # Ranks run steps in order: the step every rank answered is the oldest, and
            # the next one owed runs now.
            self._end(sent)
            sent.set_result(sent.results[min(sent.results)])
            owed = self._owed()
            if owed and owed[0].timer is None:
                self._arm(owed[0])

    # -- losses ------------------------------------------------------------------------------

    def _arm(self, sent: _SentStep) -> None:
        """Start the step's timeout: it is the oldest owed, so running now."""
        sent.timer = asyncio.get_running_loop().call_later(
            self.step_timeout_s, self._timed_out, sent
        )

    def _end(self, sent: _SentStep) -> None:
        if sent.timer is not None:
            sent.timer.cancel()

    def _fail_all(self, reason: str) -> None:
        """Fail every step owed (the device cache they build on is gone)."""
        for sent in self._owed():
            self._end(sent)
            sent.set_exception(StepLostError(reason))

    def _timed_out(self, sent: _SentStep) -> None:
        """Workers that still owe a step after step_timeout_s are hung (a stuck kernel
        keeps heartbeats going): kill them, so serve or systemd starts fresh ones."""
        owed = self._owed()
        if not owed or owed[0] is not sent:
            return
        for identity in list(sent.pending):
            handle = self.registry.drop(identity)
            if handle is None:
                continue
            log.error(
                "worker rank %d (pid %d) did not finish step %d in %g s: killing it",
                handle.rank,
                handle.pid,
                sent.step,
                self.step_timeout_s,
            )
            self._send_off(handle)
        self._fail_all(f"step {sent.step} hung")
        self._take_down_group()

    def _lose(self, identity: bytes) -> None:
        handle = self.registry.drop(identity)
        if handle is not None:
            self._on_lost(handle)

    def _on_lost(self, handle: WorkerHandle) -> None:
        """The device cache of a dropped worker is gone: fail the steps owed (their
        driver then re-queues), or have the host re-queue now if none is. A worker given
        up on while it may still live (silent, not dead) is sent off, so that its
        supervisor or systemd starts a fresh one: it could never rejoin as it is."""
        log.error("worker rank %d (pid %d) lost", handle.rank, handle.pid)
        self._send_off(handle)
        self._take_down_group()
        if self._owed():
            self._fail_all(f"rank {handle.rank} lost")
        else:
            self.host.worker_lost_idle()

    def _take_down_group(self) -> None:
        """A tensor-parallel group is restarted as a whole (torch.distributed cannot lose
        a member; the others would wait on it in their next collective): drop every
        other rank, tell it to leave, and kill it when it runs on this machine (it may
        be stuck in a collective), so serve or systemd starts them all afresh."""
        if not self.group:
            return
        for other in list(self.registry.workers.values()):
            self.registry.drop(other.identity)
            log.error("rank %d (pid %d) leaves with its group", other.rank, other.pid)
            self._send_off(other)

    def _send_off(self, handle: WorkerHandle) -> None:
        """Tell a dropped worker to leave and restart (exit status 3), and kill it when
        it runs in this pid namespace and is still the process that joined (pid and
        start time): it may be too stuck to read the message."""
        self.send(handle, Shutdown(restart=True))
        if handle.start_time and process_alive(handle.pid, handle.start_time):
            try:
                os.kill(handle.pid, signal.SIGKILL)
            except OSError as exc:  # gone already, or not ours to kill
                log.warning("could not kill pid %d: %s", handle.pid, exc)


def _log_send_failure(future: asyncio.Future[object]) -> None:
    if not future.cancelled() and (error := future.exception()) is not None:
        log.warning("sending to a worker failed: %r", error)
