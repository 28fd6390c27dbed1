"""The scheduler daemon's client side: decoding client frames, admitting and aborting
requests, answering inspect and health. A mixin of :class:`SchedulerDaemon`; every
reply goes out through its non-blocking ``_send``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from ipc.schema import (
    Abort,
    AbortAck,
    Accepted,
    ErrorReply,
    Generate,
    Health,
    HealthStatus,
    Inspect,
    InspectReply,
    Ping,
    Pong,
    ServerMessage,
    client_decoder,
    encode,
)
from scheduler_svc.outputs import ClientRequest, OutputProcessor, StepEvents
from scheduler_svc.request import FinishReason, RejectedError

if TYPE_CHECKING:
    from scheduler_svc.scheduler import Scheduler
    from scheduler_svc.workers import WorkerRegistry
    from shared.config import SchedulerConfig
    from shared.server_config import ServerConfig

log = logging.getLogger("expeditor.scheduler")

REJECT_CODES = {
    "invalid": "bad_request",
    "duplicate": "duplicate",
    "too_long": "rejected",
    "overloaded": "overloaded",
}


class FrontendMixin:
    server: ServerConfig
    config: SchedulerConfig
    frontend: zmq.asyncio.Socket
    core: Scheduler | None
    outputs: OutputProcessor
    registry: WorkerRegistry
    model: str
    backlog: list[tuple[bytes, Generate]]
    clients: dict[bytes, float]
    events: asyncio.Queue[StepEvents | tuple[str, str, str, str]]
    wake: asyncio.Event
    started: float
    stopping: bool

    def _send(self, identity: bytes, message: ServerMessage) -> None:
        """Never blocks: a client that cannot take more loses the message (logged)."""
        try:
            self.frontend.send_multipart([identity, encode(message)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped a %s for a client that is not reading", type(message).__name__)

    async def _frontend_loop(self) -> None:
        while True:
            frames = await self.frontend.recv_multipart()
            identity = frames[0]
            self.clients[identity] = time.monotonic()
            if len(frames) != 2:
                self._send(
                    identity,
                    ErrorReply(
                        request_id=None,
                        code="bad_request",
                        message="expected one frame per message",
                    ),
                )
                continue
            try:
                message = client_decoder.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._send(
                    identity,
                    ErrorReply(
                        request_id=None, code="bad_request", message=f"malformed message: {exc}"
                    ),
                )
                continue
            if isinstance(message, Generate):
                self._generate(identity, message)
            elif isinstance(message, Abort):
                self._abort(identity, message.request_id)
            elif isinstance(message, Inspect):
                self._send(identity, self._inspect())
            elif isinstance(message, Health):
                self._send(identity, self._health())
            elif isinstance(message, Ping):
                self._send(identity, Pong())

    def _refuse(self, identity: bytes, request_id: str | None, code: str, message: str) -> None:
        self._send(identity, ErrorReply(request_id=request_id, code=code, message=message))

    def _generate(self, identity: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if self.stopping:
            return self._refuse(identity, rid, "shutting_down", "the server is shutting down")
        if not rid:
            return self._refuse(identity, rid, "bad_request", "request_id must not be empty")
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            return self._refuse(
                identity, rid, "bad_request", "give exactly one of prompt and prompt_token_ids"
            )
        if rid in self.outputs.requests:
            return self._refuse(identity, rid, "duplicate", f"request_id {rid!r} is in use")
        if self.core is None:
            if len(self.backlog) >= self.config.max_waiting_requests:
                return self._refuse(
                    identity, rid, "overloaded", "no worker yet and the queue is full"
                )
            self.backlog.append((identity, msg))
            self.outputs.requests[rid] = self._client_request(identity, msg, [])
            return None
        self._submit(identity, msg)
        return None

    def _client_request(self, identity: bytes, msg: Generate, prompt: list[int]) -> ClientRequest:
        return ClientRequest(
            request_id=msg.request_id,
            client=identity,
            stream=msg.stream,
            params=msg.sampling,
            prompt_token_ids=prompt,
            arrival=time.monotonic(),
        )

    def _submit(self, identity: bytes, msg: Generate) -> None:
        assert self.core is not None and self.outputs.tokenizer is not None
        rid = msg.request_id
        if msg.prompt is not None:
            prompt = self.outputs.tokenizer.encode(msg.prompt, add_special_tokens=True).ids
        else:
            prompt = list(msg.prompt_token_ids or [])
        try:
            self.core.add_request(rid, prompt, msg.sampling, priority=msg.priority)
        except RejectedError as exc:
            self.outputs.requests.pop(rid, None)
            return self._refuse(identity, rid, REJECT_CODES[exc.code], exc.message)
        request = self.outputs.requests.get(rid) or self._client_request(identity, msg, prompt)
        request.prompt_token_ids = prompt
        self.outputs.requests[rid] = request
        self._send(identity, Accepted(request_id=rid, prompt_token_ids=prompt))
        self.wake.set()
        return None

    def _abort(self, identity: bytes, request_id: str) -> None:
        if request_id not in self.outputs.requests:
            return self._refuse(
                identity, request_id, "unknown_request", f"no live request {request_id!r}"
            )
        self._end_request(request_id)
        self._send(identity, AbortAck(request_id=request_id, aborted=True))
        return None

    def _end_request(self, request_id: str, code: str = "", message: str = "") -> None:
        """Abort a request wherever it is (backlog, core) and tell its client, in event
        order: Finished with reason "abort", or, given a ``code``, ErrorReply."""
        self.backlog = [(i, m) for i, m in self.backlog if m.request_id != request_id]
        if self.core is not None:
            self.core.abort(request_id)
        if code:
            self.events.put_nowait(("fail", request_id, code, message))
        else:
            self.events.put_nowait(("finish", request_id, "abort", ""))

    def _stop_seq(self, seq_id: str) -> None:
        """A stop string ended a sample: end it in the core; finish the request if done."""
        if self.core is None:
            return
        seq = self.core.seqs.get(seq_id)
        if seq is None:
            return
        self.core.finish_seq(seq_id, FinishReason.STOP)
        if seq.request.finished:
            self.outputs.finish(seq.request.request_id)

    def _inspect(self) -> InspectReply:
        config = self.core.config if self.core is not None else self.config
        return InspectReply(
            snapshot=self.core.snapshot() if self.core is not None else None,
            workers=self.registry.info(),
            config=msgspec.to_builtins(config),
            model=self.model,
            frontend=self.server.frontend,
        )

    def _health(self) -> HealthStatus:
        ready = len(self.registry.ready())
        if self.core is None or not self.registry.ever_ready:
            status = "starting"
        elif ready >= self.registry.expected:
            status = "ok"
        else:
            status = "degraded"
        return HealthStatus(
            status=status,
            workers_ready=ready,
            workers_expected=self.registry.expected,
            step=self.core.step if self.core is not None else 0,
            uptime_s=time.monotonic() - self.started,
        )
