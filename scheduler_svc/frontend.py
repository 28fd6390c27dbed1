"""The scheduler daemon's client side, :class:`Frontend`: decoding client frames,
admitting and aborting requests, answering inspect and health, and (through its
:class:`OutputProcessor`) the replies of each step. :class:`SchedulerDaemon` owns one;
every reply goes out through its non-blocking :meth:`Frontend.send`.

Nothing a client sends can stop this loop: frames above ``max_frame_bytes`` never
arrive (ZeroMQ disconnects their sender), every other frame is decoded under a
catch-all that answers ``bad_request``, and a failure while handling a decoded message
is logged and answered ``internal``. Text prompts beyond ``max_prompt_bytes`` are
refused before tokenizing; long ones are tokenized on a thread, off the event loop.

Each request belongs to the client that sent it: its CURVE public key when the socket
authenticates clients (the ZAP ``User-Id``), else its connection. Only the owner may
abort it. Fair-share admission and the ``max_queued_per_user`` cap count requests per
(owner, ``Generate.user``): a shared client such as the HTTP gateway names the end user
of each request, so its users are served round-robin like separate clients.

Replies go out through a :class:`~scheduler_svc.reply_outbox.ReplyOutbox`: none is lost
silently (a full pipe holds them back, bounded; numbered replies show a client any gap).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from ipc.schema import (
    Abort,
    AbortAck,
    Accepted,
    ClientMessage,
    ErrorCode,
    ErrorReply,
    Generate,
    Health,
    HealthState,
    HealthStatus,
    Inspect,
    InspectReply,
    Metrics,
    MetricsReply,
    Ping,
    Pong,
    ServerMessage,
    client_decoder,
)
from scheduler_svc.core.introspection import snapshot
from scheduler_svc.core.request import RejectedError, TokenConstraint
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.outputs import ClientRequest, OutputProcessor, RequestEnded
from scheduler_svc.reply_outbox import ReplyOutbox
from scheduler_svc.structured_output import COMPILE_THREADS, GrammarCompiler
from shared.errors import InvalidRequestError
from shared.memory import malloc_trim
from shared.structured_output import StructuredOutput
from shared.tokenizer import INLINE_TOKENIZE_CHARS, encode_ids

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from scheduler_svc.core.scheduler import Scheduler
    from scheduler_svc.step_times import StepTimer
    from scheduler_svc.workers import WorkerRegistry
    from shared.config import SchedulerConfig
    from shared.server_config import ServerConfig

log = logging.getLogger("expeditor.scheduler")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc) or type(exc).__name__


class _Named(msgspec.Struct):
    """Any map frame, for the request id it names."""

    request_id: object = None


def named_request(frame: memoryview) -> str | None:
    """The request id a frame that failed to decode names (a Generate whose fields are
    wrong, say), so that its sender learns which request was refused; None when it names
    none a client could have sent."""
    try:
        request_id = msgspec.msgpack.decode(frame, type=_Named).request_id
    except Exception:  # not a map, nested too deeply...
        return None
    return request_id if isinstance(request_id, str) else None


def frame_owner(frame: zmq.Frame, identity: bytes) -> bytes:
    """Who sent ``frame``: ``key:<Z85 public key>`` when the socket authenticates with
    CURVE, else the connection's routing id."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:  # no ZAP handler on this socket
        return identity
    return b"key:" + user_id.encode() if user_id else identity


def fair_share_client(owner: bytes, user: str) -> str:
    """The name fair share and the per-user cap count a request under: its owner, and
    the end user it names if any."""
    return owner.hex() if not user else f"{owner.hex()}/{user}"


class Frontend:
    """The client socket of the daemon and every request on it, from Generate to the
    last reply. Requests that arrive before the core exists wait in ``backlog`` until
    :meth:`attach`."""

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        server: ServerConfig,
        config: SchedulerConfig,
        registry: WorkerRegistry,
        events: asyncio.Queue[StepOutput | RequestEnded],
        wake: asyncio.Event,
        finish_seq: Callable[[str], str | None],
        *,
        step_times: StepTimer | None = None,
    ) -> None:
        """``events`` is the output task's queue (requests ended here go in it), ``wake``
        wakes the step loop, ``finish_seq`` ends a sample a stop string stopped,
        ``step_times`` is where the steps' time went (for inspect)."""
        self.socket = socket
        self.outbox = ReplyOutbox(socket, server.max_reply_backlog_bytes, self._client_overflowed)
        self.server = server
        self.config = config
        self.registry = registry
        self.events = events
        self.wake = wake
        self.outputs = OutputProcessor(None, self.send, finish_seq)
        self.step_times = step_times
        self.core: Scheduler | None = None
        self.model = server.model
        self.backlog: list[tuple[ClientRequest, Generate]] = []
        """Requests that arrived before the first worker registered (no tokenizer yet)."""
        self.tokenizing: set[asyncio.Task[None]] = set()
        self.grammars: asyncio.Future[GrammarCompiler] | None = None
        """The structured-output compiler, built on a thread once the core exists (its
        tokenizer takes ~0.5 s: not on the first constrained request's time)."""
        self.clients: dict[bytes, float] = {}
        """Connection -> when it was last heard from."""
        self.started = time.monotonic()
        self.instance = secrets.token_hex(8)
        """This run of the server, in every Pong (see :class:`~ipc.schema.Pong`)."""
        self.stopping = False
        """Draining: new requests are refused with ``shutting_down``."""

    def attach(self, core: Scheduler, model: str, tokenizer: Tokenizer) -> None:
        """The core exists (the first worker said hello): submit the backlog to it."""
        self.core = core
        self.model = model
        self.outputs.tokenizer = tokenizer
        backlog, self.backlog = self.backlog, []
        for request, msg in backlog:
            self._submit(request, msg)

    def build_grammars(self) -> asyncio.Future[GrammarCompiler]:
        """The compiler's future, started on a thread the first time (the daemon starts
        it once the core exists; else the first constrained request does)."""
        assert self.core is not None and self.outputs.tokenizer is not None
        if self.grammars is None:
            loop = asyncio.get_running_loop()
            self.grammars = loop.run_in_executor(
                COMPILE_THREADS, GrammarCompiler.for_scheduler, self.outputs.tokenizer, self.core
            )
            self.grammars.add_done_callback(_log_failure)
        return self.grammars

    def send(self, identity: bytes, message: ServerMessage) -> None:
        """Never blocks: a reply a client cannot take yet waits in its bounded backlog."""
        self.outbox.send(identity, message)

    def _client_overflowed(self, identity: bytes) -> None:
        """``identity`` read nothing while its backlog grew past the limit: its replies
        were dropped (it sees the gap); stop working for it."""
        limit = self.server.max_reply_backlog_bytes
        for request_id, request in list(self.outputs.requests.items()):
            if request.client == identity:
                self.end_request(
                    request_id,
                    ErrorCode.INTERNAL,
                    f"replies to this client were dropped: it read none while more than "
                    f"max_reply_backlog_bytes={limit} waited",
                )

    async def run(self) -> None:
        """Serve client frames until cancelled."""
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            identity = frames[0].bytes
            self.clients[identity] = time.monotonic()
            if len(frames) != 2:
                self._refuse(
                    identity, None, ErrorCode.BAD_REQUEST, "expected one frame per message"
                )
                continue
            try:
                message = client_decoder.decode(frames[1].buffer)
            except Exception as exc:  # any bytes at all: DecodeError, RecursionError...
                request_id = named_request(frames[1].buffer)
                why = f"malformed message: {_describe(exc)}"
                self._refuse(identity, request_id, ErrorCode.BAD_REQUEST, why)
                continue
            try:
                self._dispatch(identity, frame_owner(frames[1], identity), message)
            except Exception:  # a bug in one handler must not take the server down
                log.exception("handling a %s failed", type(message).__name__)
                request_id = getattr(message, "request_id", None)
                self._refuse(
                    identity, request_id, ErrorCode.INTERNAL, "the server failed to handle this"
                )

    def _dispatch(self, identity: bytes, owner: bytes, message: ClientMessage) -> None:
        if isinstance(message, Generate):
            self._generate(identity, owner, message)
        elif isinstance(message, Abort):
            self._abort(identity, owner, message.request_id)
        elif isinstance(message, Inspect):
            self.send(identity, self._inspect())
        elif isinstance(message, Health):
            self.send(identity, self._health())
        elif isinstance(message, Metrics):
            self.send(identity, self._metrics())
        elif isinstance(message, Ping):
            if message.sequenced:
                self.outbox.sequence(identity)
            self.send(identity, Pong(instance=self.instance))

    def _refuse(
        self,
        identity: bytes,
        request_id: str | None,
        code: ErrorCode,
        message: str,
        field: str | None = None,
    ) -> None:
        reply = ErrorReply(request_id=request_id, code=code, message=message, field=field)
        self.send(identity, reply)

    def _generate(self, identity: bytes, owner: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if self.stopping:
            return self._refuse(
                identity, rid, ErrorCode.SHUTTING_DOWN, "the server is shutting down"
            )
        if not rid:
            return self._refuse(
                identity, rid, ErrorCode.BAD_REQUEST, "request_id must not be empty"
            )
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            return self._refuse(
                identity,
                rid,
                ErrorCode.BAD_REQUEST,
                "give exactly one of prompt and prompt_token_ids",
            )
        if rid in self.outputs.requests:
            return self._refuse(identity, rid, ErrorCode.DUPLICATE, f"request_id {rid!r} is in use")
        limit = self.server.max_prompt_bytes
        if msg.prompt is not None and len(msg.prompt) > limit // 4:  # cheap before exact
            size = len(msg.prompt.encode("utf-8", "surrogatepass"))
            if size > limit:
                return self._refuse(
                    identity,
                    rid,
                    ErrorCode.BAD_REQUEST,
                    f"prompt is {size} bytes; this server takes at most max_prompt_bytes={limit}",
                    "prompt",
                )
        if self.core is None and len(self.backlog) >= self.config.max_waiting_requests:
            return self._refuse(
                identity, rid, ErrorCode.OVERLOADED, "no worker yet and the queue is full"
            )
        request = ClientRequest(
            request_id=rid,
            client=identity,
            owner=owner,
            stream=msg.stream,
            params=msg.sampling,
            prompt_token_ids=[],
            arrival=time.monotonic(),
        )
        self.outputs.requests[rid] = request
        self._submit(request, msg)
        return None

    def _submit(self, request: ClientRequest, msg: Generate) -> None:
        """Tokenize (inline, or on a thread when long) and hand the request to the core;
        before the first worker registered there is no tokenizer yet: keep it back."""
        if self.core is None:
            self.backlog.append((request, msg))
            return
        structured = msg.sampling.structured_outputs is not None
        if not structured and (msg.prompt is None or len(msg.prompt) <= INLINE_TOKENIZE_CHARS):
            self._admit(request, msg, self._tokenize(msg))
            return
        task = asyncio.create_task(self._tokenize_off_loop(request, msg))
        self.tokenizing.add(task)
        task.add_done_callback(self.tokenizing.discard)

    def _tokenize(self, msg: Generate) -> list[int]:
        if msg.prompt is None:
            return list(msg.prompt_token_ids or [])
        assert self.outputs.tokenizer is not None
        # A long prompt is tokenized on a thread (_tokenize_off_loop): encode_ids releases
        # the GIL, so it does not stall the event loop.
        return encode_ids(self.outputs.tokenizer, msg.prompt)

    async def _tokenize_off_loop(self, request: ClientRequest, msg: Generate) -> None:
        """Tokenize on a thread (a long prompt), and compile the request's structured
        output there: neither holds up the event loop or the other requests."""
        constraint = None
        try:
            prompt = await asyncio.to_thread(self._tokenize, msg)
            if msg.sampling.structured_outputs is not None:
                constraint = await self._compile(msg.sampling.structured_outputs)
        except RejectedError as exc:
            if self.outputs.requests.get(request.request_id) is request and not request.ending:
                self.outputs.requests.pop(request.request_id)
                self._refuse(request.client, request.request_id, exc.code, exc.message, exc.field)
            return
        finally:
            malloc_trim()
        # Not aborted meanwhile (its RequestEnded may still wait for the output task).
        if self.outputs.requests.get(request.request_id) is request and not request.ending:
            self._admit(request, msg, prompt, constraint)

    async def _compile(self, spec: StructuredOutput) -> TokenConstraint:
        """``spec``'s matcher, compiled on a thread; RejectedError (bad_request) naming
        the problem, or the time limit when compiling takes longer."""
        grammars = self.build_grammars()
        limit = self.server.grammar_compile_timeout_s
        try:
            async with asyncio.timeout(limit):
                compiler = await asyncio.shield(grammars)
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(COMPILE_THREADS, compiler.compile, spec)
        except InvalidRequestError as exc:
            raise RejectedError(ErrorCode.BAD_REQUEST, str(exc), exc.field) from None
        except TimeoutError:
            raise RejectedError(
                ErrorCode.BAD_REQUEST,
                f"structured_outputs: compiling its {spec.kind} took longer than "
                f"grammar_compile_timeout_s={limit:g}",
                "structured_outputs",
            ) from None
        except Exception as exc:  # the library itself failing: not the request's fault
            log.exception("compiling a structured output failed")
            raise RejectedError(
                ErrorCode.INTERNAL, f"structured_outputs: the grammar compiler failed: {exc}"
            ) from None

    def _admit(
        self,
        request: ClientRequest,
        msg: Generate,
        prompt: list[int],
        constraint: TokenConstraint | None = None,
    ) -> None:
        assert self.core is not None
        rid = request.request_id
        client = fair_share_client(request.owner, msg.user)
        try:
            self._check_user_cap(client, msg.user)
            self.core.add_request(
                rid, prompt, msg.sampling, priority=msg.priority, client=client,
                constraint=constraint,
            )  # fmt: skip
        except RejectedError as exc:
            self.outputs.requests.pop(rid, None)
            return self._refuse(request.client, rid, exc.code, exc.message, exc.field)
        request.prompt_token_ids = prompt
        self.send(request.client, Accepted(request_id=rid, prompt_token_ids=prompt))
        self.wake.set()
        return None

    def _check_user_cap(self, client: str, user: str) -> None:
        """Refuse (overloaded) a request of a user who already has ``max_queued_per_user``
        unfinished requests (waiting or running)."""
        assert self.core is not None
        cap = self.core.config.user_queue_cap
        held = self.core.fair_share.unfinished(client)
        if held >= cap:
            who = f"user {user!r}" if user else "this client"
            raise RejectedError(
                ErrorCode.OVERLOADED,
                f"{who} has {held} requests queued or running; the server takes at most "
                f"max_queued_per_user={cap} per user; retry later",
            )

    def _abort(self, identity: bytes, owner: bytes, request_id: str) -> None:
        """Only the owner may abort; a repeat, or an abort of a request that already
        finished, is acknowledged with ``aborted=False``."""
        request = self.outputs.requests.get(request_id)
        if request is not None and request.owner == owner:
            aborted = not request.ending
            if aborted:
                self.end_request(request_id)
            return self.send(identity, AbortAck(request_id=request_id, aborted=aborted))
        if self.outputs.finished_owners.get(request_id) == owner:
            return self.send(identity, AbortAck(request_id=request_id, aborted=False))
        return self._refuse(
            identity,
            request_id,
            ErrorCode.UNKNOWN_REQUEST,
            f"this client has no request {request_id!r}",
        )

    def end_request(
        self, request_id: str, code: ErrorCode | None = None, message: str = ""
    ) -> None:
        """Abort a request wherever it is (backlog, tokenizer, core) and tell its client,
        in event order: Finished with reason ``abort``, or, given a ``code``, ErrorReply."""
        request = self.outputs.requests.get(request_id)
        if request is None or request.ending:
            return
        request.ending = True
        self.backlog = [(r, m) for r, m in self.backlog if r is not request]
        if self.core is not None:
            self.core.abort(request_id)
        self.events.put_nowait(RequestEnded(request_id, code, message))

    def _inspect(self) -> InspectReply:
        config = self.core.config if self.core is not None else self.config
        times = self.step_times if self.step_times is not None and self.step_times.steps else None
        return InspectReply(
            snapshot=snapshot(self.core) if self.core is not None else None,
            workers=self.registry.info(),
            config=msgspec.to_builtins(config),
            model=self.model,
            frontend=self.server.frontend,
            step_times=times.recent() if times is not None else None,
            step_times_total=times.total() if times is not None else None,
        )

    def _metrics(self) -> MetricsReply:
        core, metrics = self.core, self.outputs.metrics
        running = waiting = swapped = 0
        kv_usage = cpu_usage = 0.0
        preemptions: dict[str, int] = {}
        queried = hits = host_hits = demoted = 0
        spec = None
        cache_config: dict[str, str] = {}
        if core is not None:
            cfg = core.config
            cache_config = {
                "block_size": str(cfg.block_size),
                "num_gpu_blocks": str(core.kv.pool.num_blocks),
                "num_cpu_blocks": str(cfg.num_cpu_blocks),
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "prefix_cache_cpu_blocks": str(cfg.prefix_cache_cpu_blocks),
                "cache_dtype": self.server.kv_cache_dtype,
                "sliding_window": str(core.kv.window),
            }
            spec = core.speculation
            running, waiting, swapped = len(core.running), len(core.waiting), len(core.swapped)
            gpu, cpu = core.kv.pool, core.kv.cpu_pool
            kv_usage = 1 - gpu.num_free / gpu.num_blocks if gpu.num_blocks else 0.0
            cpu_usage = 1 - cpu.num_free / cpu.num_blocks if cpu.num_blocks else 0.0
            preemptions = dict(core.preemptions)
            queried, hits = core.kv.queried_tokens, core.kv.hit_tokens
            if (host := core.kv.host) is not None:
                host_hits, demoted = host.hit_tokens, host.num_demoted
        return MetricsReply(
            model=self.model,
            num_requests_running=running,
            num_requests_waiting=waiting + len(self.backlog),
            num_requests_swapped=swapped,
            kv_cache_usage_perc=kv_usage,
            cpu_swap_usage_perc=cpu_usage,
            num_preemptions=preemptions,
            prompt_tokens=metrics.prompt_tokens,
            generation_tokens=metrics.generation_tokens,
            prefix_cache_queries=queried,
            prefix_cache_hits=hits,
            prefix_cache_host_hits=host_hits,
            prefix_cache_host_demoted_blocks=demoted,
            request_success=dict(metrics.request_success),
            histograms=metrics.histograms(),
            spec_decode_num_drafts=spec.num_drafts if spec else 0,
            spec_decode_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_position)
            if spec
            else [],
            cache_config=cache_config,
        )

    def _health(self) -> HealthStatus:
        ready = len(self.registry.ready())
        if self.stopping:
            status = HealthState.DRAINING
        elif self.core is None or not self.registry.ever_ready:
            status = HealthState.STARTING
        elif ready >= self.registry.expected:
            status = HealthState.OK
        else:
            status = HealthState.DEGRADED
        return HealthStatus(
            status=status,
            workers_ready=ready,
            workers_expected=self.registry.expected,
            step=self.core.step if self.core is not None else 0,
            uptime_s=time.monotonic() - self.started,
        )

    def check_clients(self, now: float) -> None:
        """Abort the requests of clients silent for ``client_timeout_s`` and forget them."""
        silent = {
            c for c, seen in self.clients.items() if now - seen > self.server.client_timeout_s
        }
        if not silent:
            return
        for request_id, request in list(self.outputs.requests.items()):
            if request.client in silent:
                log.info("client went silent: aborting %s", request_id)
                self.end_request(request_id)
        for client in silent:
            del self.clients[client]
            self.outbox.forget(client)


def _log_failure(future: asyncio.Future[GrammarCompiler]) -> None:
    """Building the compiler failed: said once here (each constrained request then fails
    with it, as an internal error)."""
    if not future.cancelled() and future.exception() is not None:
        log.error("the structured-output compiler could not be built", exc_info=future.exception())
