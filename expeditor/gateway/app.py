"""The gateway's FastAPI application: OpenAI routes in front of the scheduler, reached
through one :class:`~ipc.async_client.AsyncClient` (one connection, many requests).

Every error is an OpenAI error object with a fitting status: 400 for a bad request
(naming the field), 401 without the API key, 404 for an unknown model or route, 413
for a body over ``max_body_bytes``, 429 when the scheduler's queue is full, 503 while
it starts, shuts down, has no worker or does not answer. A client that disconnects
aborts its requests at once (their KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from expeditor.gateway.chat import render_messages
from expeditor.gateway.completions import ChatHandler, CompletionHandler
from expeditor.gateway.discovery import add_discovery_routes
from expeditor.gateway.http import (
    ClientGone,
    EventStreamResponse,
    Stopped,
    check_api_key,
    read_body,
    unless_gone,
)
from expeditor.gateway.identity import check_priority, end_user
from expeditor.gateway.metrics import PREFIXES, MetricsCache
from expeditor.gateway.model import ServedModel
from expeditor.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GatewayRequestError,
    TokenizeRequest,
    decode_body,
)
from expeditor.gateway.replicas import ReplicaRouter, merge_replies
from expeditor.gateway.responses import error_body, error_of, json_bytes
from expeditor.gateway.tools import plan_tools
from ipc.async_client import AsyncClient
from ipc.errors import (
    UNREACHABLE,
    ServerError,
)
from ipc.schema import HealthState
from shared.config_fields import field_spec
from shared.gateway_config import GatewayConfig
from shared.memory import Trimmer
from shared.server_config import ServerConfig
from shared.tokenizer import INLINE_TOKENIZE_CHARS

__all__ = ["Gateway", "create_app"]

try:
    VERSION = importlib.metadata.version("expeditor")
except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
    VERSION = "unknown"

log = logging.getLogger("expeditor.gateway")

CONTROL_TIMEOUT_S = 5.0
"""How long /metrics and the model lookup wait for the scheduler."""
HEALTH_TIMEOUT_S = 2.0
"""How long /health waits: a probe gets its 503 within a load balancer's timeout."""
MAX_PROMPT_BYTES: int = field_spec(ServerConfig, "max_prompt_bytes").default  # type: ignore[assignment]
"""The scheduler's limit on a text prompt when the gateway is not told it: its declared
default (``[server] max_prompt_bytes``)."""
TRIM_AFTER_BYTES = 256 * 1024
"""After a request with a body this large, freed heap is handed back to the OS."""
_LARGE_BODY: ContextVar[Trimmer | None] = ContextVar("large_body", default=None)
"""The gateway's trimmer, set (for the request's task) when its body was at least
TRIM_AFTER_BYTES."""


class Gateway:
    """State shared by the routes: the scheduler client and the served model."""

    def __init__(
        self,
        frontend: str,
        config: GatewayConfig,
        *,
        api_key: str | None = None,
        curve: dict[str, bytes] | None = None,
        max_prompt_bytes: int = MAX_PROMPT_BYTES,
        kv_event_sources: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """``max_prompt_bytes``: the scheduler's limit on a text prompt ([server]), which
        the gateway applies to the prompts it renders and tokenizes itself (chat,
        /tokenize) before spending time on them. ``kv_event_sources``: what
        /kv_event_sources answers (:func:`expeditor.gateway.discovery.kv_event_sources`)."""
        self.kv_event_sources = kv_event_sources or {}
        self.frontend = frontend
        self.frontends = config.replica_list or [frontend]
        """The schedulers this gateway sends to: one, or data-parallel replicas."""
        self.max_prompt_bytes = max_prompt_bytes
        self.config = config
        self.api_key = api_key.encode() if api_key else None
        self.curve = curve or {}
        self.client: AsyncClient | None = None
        """The first replica's client (the only one without replicas)."""
        self.clients: list[AsyncClient] = []
        self.replicas: ReplicaRouter | None = None
        """With several replicas: which one runs each request."""
        self.model: ServedModel | None = None
        self._model_lock = asyncio.Lock()
        self.stopping = False
        """Stopping: new requests get 503; those in flight get :meth:`drain`'s grace."""
        self.active = 0
        """Generation requests whose response is not over."""
        self.stop_now = asyncio.Event()
        """Set when the grace is over: open streams end with an error event."""
        self.trimmer = Trimmer()
        """Returns the memory of large requests once they are over."""
        self.metrics = MetricsCache(
            self.metrics_reply,
            config.metrics_interval_s,
            prefixes=PREFIXES[config.metrics_prefix],
        )
        """/metrics snapshots, shared by concurrent scrapes."""

    async def metrics_reply(self) -> Any:
        """The scheduler's metrics (the replicas' merged)."""
        assert self.client is not None
        if self.replicas is None:
            return await self.client.metrics(timeout=CONTROL_TIMEOUT_S)
        replies = await asyncio.gather(
            *(c.metrics(timeout=CONTROL_TIMEOUT_S) for c in self.clients), return_exceptions=True
        )
        answered = [r for r in replies if not isinstance(r, BaseException)]
        if not answered:
            raise replies[0]  # type: ignore[misc]
        return merge_replies(answered)

    def start(self) -> None:
        timeout = self.config.scheduler_timeout_s
        self.clients = [
            AsyncClient(
                frontend,
                timeout=None,
                ping_interval=min(1.0, timeout / 3),
                server_timeout_s=timeout,
                **self.curve,  # type: ignore[arg-type]  # the three CURVE keyword arguments
            )
            for frontend in self.frontends
        ]
        self.client = self.clients[0]
        if len(self.clients) > 1:
            self.replicas = ReplicaRouter(self.clients, self.config.replica_kv_event_list)
            self.replicas.start()

    async def stop(self) -> None:
        if self.replicas is not None:
            await self.replicas.stop()
        for client in self.clients:
            await client.close()

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; give those in flight ``grace_s`` to finish, then end the
        rest (streams with an error event and ``[DONE]``, others with a 503)."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("stopping: ending %d request(s) still open", self.active)
            self.stop_now.set()
            deadline = loop.time() + 2.0
            while self.active and loop.time() < deadline:
                await asyncio.sleep(0.02)

    def finished(self) -> None:
        self.active -= 1
        self.metrics.invalidate()  # the next scrape counts this request
        _trim_if_large()

    async def served_model(self) -> ServedModel:
        """The model, looked up once the scheduler has a worker (503 before)."""
        if self.model is not None:
            return self.model
        async with self._model_lock:
            if self.model is None:
                assert self.client is not None
                client = self.client
                if self.replicas is not None:  # one that answers
                    client = self.clients[self.replicas.first_up()]
                reply = await client.inspect(timeout=CONTROL_TIMEOUT_S)
                if reply.snapshot is None:
                    raise GatewayRequestError(
                        "the server is starting: no worker has registered yet",
                        status=503,
                        kind="ServiceUnavailableError",
                    )
                self.model = await asyncio.to_thread(
                    ServedModel.from_inspect,
                    reply,
                    self.config.served_model_name,
                    self.config.chat_template,
                )
                log.info("serving %s as %r", self.model.path, self.model.name)
            return self.model

    def check_model(self, model: ServedModel, name: str | None) -> None:
        if name is not None and name != model.name:
            raise GatewayRequestError(
                f"The model `{name}` does not exist; this server serves `{model.name}`.",
                status=404,
                param="model",
                kind="NotFoundError",
            )

    async def encode(
        self, model: ServedModel, text: str, *, special: bool, field: str = "prompt"
    ) -> list[int]:
        """Token ids of a text the gateway tokenizes itself; a 400 naming ``field`` when
        it is beyond max_prompt_bytes."""
        limit = self.max_prompt_bytes
        if len(text) > limit // 4 and (size := len(text.encode("utf-8", "replace"))) > limit:
            raise GatewayRequestError(
                f"{field}: the prompt is {size} bytes; this server takes at most "
                f"max_prompt_bytes={limit}",
                param=field,
            )
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return model.encode(text, add_special_tokens=special)
        return await asyncio.to_thread(model.encode, text, add_special_tokens=special)


def _error_response(exc: Exception) -> Response:
    """The OpenAI error object for anything a route raised, with its status."""
    body = error_of(exc)
    return Response(
        json_bytes(body), status_code=body["error"]["code"], media_type="application/json"
    )


@functools.cache
def _encode_names(kind: type[Any]) -> frozenset[str]:
    """The JSON names of ``kind``'s fields, once per type (``msgspec.structs.fields``
    evaluates every annotation: most of a render request's time when done per request)."""
    return frozenset(field.encode_name for field in msgspec.structs.fields(kind))


def _known_fields(raw: bytes, kind: type[Any], ignored: list[str]) -> bytes:
    """``raw`` without the top-level fields ``kind`` does not declare (their names added
    to ``ignored``); a body that is not a JSON object is left to the decoder's error."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw
    if not isinstance(data, dict):
        return raw
    known = _encode_names(kind)
    ignored += sorted(name for name in data if name not in known)
    if not ignored:
        return raw
    return msgspec.json.encode({k: v for k, v in data.items() if k in known})


async def _replicas_health(gateway: Gateway) -> Response:
    """Ready while one replica serves; each replica's state in the body."""
    replies = await asyncio.gather(
        *(c.health(timeout=HEALTH_TIMEOUT_S) for c in gateway.clients), return_exceptions=True
    )
    states = []
    for reply in replies:
        if isinstance(reply, BaseException):
            states.append({"status": "unavailable"})
        else:
            states.append({"status": reply.status.value, "workers_ready": reply.workers_ready})
    serving = sum(
        s["status"] in ("ok", "degraded") and s.get("workers_ready", 0) > 0 for s in states
    )
    body = {
        "status": "ok" if serving else "unavailable",
        "replicas_serving": serving,
        "replicas": states,
    }
    return _json(body, 200 if serving else 503)


def _json(body: dict[str, Any] | list[Any], status: int = 200) -> Response:
    return Response(json_bytes(body), status_code=status, media_type="application/json")


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI application serving ``gateway``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(
        title="expeditor", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )
    if gateway.config.api_docs:
        _add_api_docs(app, gateway)
    limit = gateway.config.max_body_bytes

    async def _open(
        request: Request, kind: type[Any], ignored: list[str] | None = None
    ) -> tuple[Any, ServedModel]:
        """The checked body of a request to the model and the model (API key, size,
        JSON, the model's name: each refused with its own error). With ``ignored``, top-
        level fields ``kind`` does not know are dropped and listed there instead of
        refused (the render routes: routers add their own fields to what they render)."""
        check_api_key(request, gateway.api_key)
        raw = await read_body(request, limit)
        if len(raw) >= TRIM_AFTER_BYTES:
            _LARGE_BODY.set(gateway.trimmer)
        if ignored is not None:
            raw = _known_fields(raw, kind, ignored)
        body = decode_body(raw, kind)
        del raw
        model = await gateway.served_model()
        gateway.check_model(model, body.model)
        return body, model

    async def _generate(request: Request, kind: type[Any], handler_type: type[Any]) -> Any:
        if gateway.stopping:
            raise GatewayRequestError(
                "the gateway is shutting down", status=503, kind="ServiceUnavailableError"
            )
        body, model = await _open(request, kind)
        check_priority(body.priority, gateway.config.min_client_priority)
        handler = handler_type(gateway, model, body, f"{handler_type.ID_PREFIX}{uuid.uuid4().hex}")
        handler.user = end_user(request, gateway.api_key is not None)
        await handler.prepare()
        gateway.active += 1
        streaming = False
        try:
            if body.stream:
                # The first event is awaited here, so that a request the scheduler
                # refuses gets its HTTP error status rather than an error event.
                events = handler.stream()
                first = await unless_gone(request, anext(events), gateway.stop_now)
                streaming = True
                return EventStreamResponse(
                    events, first=first, stop=gateway.stop_now, done=gateway.finished
                )
            return _json(await unless_gone(request, handler.complete(), gateway.stop_now))
        except ClientGone:
            log.info("client gone: aborted %s", handler.response_id)
            return Response(status_code=499)
        except Stopped:
            raise GatewayRequestError(
                "the gateway is shutting down", status=503, kind="ServiceUnavailableError"
            ) from None
        finally:
            if not streaming:
                gateway.finished()

    async def _render(request: Request, kind: type[Any], handler_type: type[Any]) -> Response:
        ignored: list[str] = []
        body, model = await _open(request, kind, ignored)
        check_priority(body.priority, gateway.config.min_client_priority)
        handler = handler_type(gateway, model, body, f"{handler_type.ID_PREFIX}{uuid.uuid4().hex}")
        await handler.prepare()
        rendered = await handler.render()
        if ignored:  # said, not silently dropped
            for item in rendered:
                item["ignored_fields"] = ignored
        return _json(rendered if handler_type is CompletionHandler else rendered[0])

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> Any:
        return await _guard(_render(request, CompletionRequest, CompletionHandler))

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(request: Request) -> Any:
        return await _guard(_render(request, ChatCompletionRequest, ChatHandler))

    add_discovery_routes(app, gateway, _guard, _json)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": VERSION})

    @app.get("/live")
    async def live() -> Response:
        """Liveness: this process answers (whatever the scheduler's state; /health is
        readiness)."""
        return _json({"status": "alive"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _guard(_generate(request, CompletionRequest, CompletionHandler))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _guard(_generate(request, ChatCompletionRequest, ChatHandler))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        async def work() -> Response:
            check_api_key(request, gateway.api_key)
            model = await gateway.served_model()
            card = {
                "id": model.name,
                "object": "model",
                "created": model.created,
                "owned_by": "expeditor",
                "root": model.path,
                "parent": None,
                "max_model_len": model.max_model_len,
            }
            return _json({"object": "list", "data": [card]})

        return await _guard(work())

    @app.get("/health")
    async def health() -> Response:
        assert gateway.client is not None
        if gateway.replicas is not None:
            return await _replicas_health(gateway)
        try:
            status = await gateway.client.health(timeout=HEALTH_TIMEOUT_S)
        except (ServerError, *UNREACHABLE):
            return _json({"status": "unavailable", "reason": "the scheduler does not answer"}, 503)
        serving = status.status in (HealthState.OK, HealthState.DEGRADED)
        body = {
            "status": status.status.value,
            "workers_ready": status.workers_ready,
            "workers_expected": status.workers_expected,
        }
        return _json(body, 200 if serving and status.workers_ready > 0 else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        def name_of(reply: Any) -> str:
            if gateway.model is not None:
                return gateway.model.name
            return gateway.config.served_model_name or reply.model

        async def work() -> Response:
            text = await gateway.metrics.text(name_of)
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        return await _guard(work())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        async def work() -> Response:
            body, model = await _open(request, TokenizeRequest)
            body.check()
            if body.messages is not None:
                plan_tools(body.tools, "none", None, "none")  # checked as chat checks them
                text = await render_messages(
                    model.template(),
                    body.messages,
                    max_messages=gateway.config.max_messages,
                    max_bytes=gateway.max_prompt_bytes,
                    timeout_s=gateway.config.render_timeout_s,
                    add_generation_prompt=body.add_generation_prompt,
                    tools=body.tools,
                )
                tokens = await gateway.encode(model, text, special=False, field="messages")
            else:
                assert body.prompt is not None
                tokens = await gateway.encode(model, body.prompt, special=body.add_special_tokens)
            return _json(
                {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}
            )

        return await _guard(work())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def work() -> Response:
            body, model = await _open(request, DetokenizeRequest)
            bad = [t for t in body.tokens if not 0 <= t < model.vocab_size]
            if bad:
                raise GatewayRequestError(
                    f"tokens: ids outside the vocabulary (size {model.vocab_size}): {bad[:5]}",
                    param="tokens",
                )
            return _json({"prompt": model.decode(body.tokens)})

        return await _guard(work())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return _json(error_body(message, kind, exc.status_code), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _json(error_body(str(exc), "BadRequestError", 400), 400)

    return app


async def _answer(work: Any) -> Any:
    """Await a route's work; any exception becomes an OpenAI error response."""
    try:
        return await work
    except Exception as exc:
        return _error_response(exc)


async def _guard(work: Any) -> Any:
    """:func:`_answer`, then the memory of a large request is handed back to the OS
    (a stream's again once it ends: :meth:`Gateway.finished`)."""
    try:
        return await _answer(work)
    finally:
        _trim_if_large()


def _trim_if_large() -> None:
    """Hand freed heap back to the OS if the current request's body was large (called
    once it is over)."""
    if (trimmer := _LARGE_BODY.get()) is not None:
        trimmer.soon()


def _add_api_docs(app: FastAPI, gateway: Gateway) -> None:
    """/openapi.json, /docs and /redoc ([gateway] api_docs), behind the API key."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    pages: dict[str, Callable[[], Response]] = {
        "/openapi.json": lambda: _json(app.openapi()),
        "/docs": lambda: get_swagger_ui_html(openapi_url="/openapi.json", title="expeditor"),
        "/redoc": lambda: get_redoc_html(openapi_url="/openapi.json", title="expeditor"),
    }

    def route(page: Callable[[], Response]) -> Callable[[Request], Awaitable[Response]]:
        async def serve(request: Request) -> Response:
            async def work() -> Response:
                check_api_key(request, gateway.api_key)
                return page()

            return await _answer(work())

        return serve

    for path, page in pages.items():
        app.add_api_route(path, route(page), methods=["GET"], include_in_schema=False)
