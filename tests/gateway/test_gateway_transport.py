"""The gateway against hostile HTTP: slow heads and bodies, huge heads, too many
connections (expeditor/gateway/transport.py), bodies that used to answer 500 (deep
JSON, integers beyond 64 bits, template-shadowing chat_template_kwargs), the API docs
behind the key, and /metrics snapshots shared by a storm of scrapes.

Each test runs a real uvicorn server on a free loopback port (in a thread of this
process, with the gateway's own protocol class) and talks raw HTTP to it; the gateway
application gets a stub scheduler client."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from support.http import get, local, post_json
from support.paths import REPO
from tokenizers import Tokenizer

from expeditor.gateway.app import Gateway, create_app
from expeditor.gateway.chat import ChatTemplate
from expeditor.gateway.http import RawSend
from expeditor.gateway.model import ServedModel
from expeditor.gateway.transport import (
    FD_HEADROOM,
    TransportLimits,
    guarded_protocol,
    reserve_open_files,
)
from ipc.schema import MetricsReply
from scheduler_svc.launch import free_port
from shared.errors import ConfigError
from shared.gateway_config import GatewayConfig

WAIT_S = 15.0
"""Generous bound on waits that only stop a hang."""
LIMITS = TransportLimits(
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    max_header_bytes=8192,
    max_header_count=20,
    max_connections=200,
    send_timeout_s=1.0,
)


async def _plain_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers its length."""
    assert scope["type"] == "http"
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(app: Any, limits: TransportLimits = LIMITS, lifespan: str = "off") -> Iterator[int]:
    """A uvicorn server with the gateway's protocol on 127.0.0.1; yields its port."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop="asyncio",
        http=guarded_protocol(limits),
        ws="none",
        lifespan=lifespan,
        log_level="warning",
        timeout_keep_alive=60,  # so that only the protocol's own deadlines close
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(WAIT_S)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as
    closed); fails if it never does within WAIT_S."""
    data = b""
    sock.settimeout(WAIT_S)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open; got {data!r}") from None
        if not chunk:
            return data
        data += chunk


def _get(port: int, path: str = "/", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return get(local(port), path, headers, timeout=WAIT_S)


def _error(reply: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)["error"]


# -- slow clients -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "field"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: a", "header_timeout_s"),
        (b"GET / HTT", "header_timeout_s"),
        (b"", "header_timeout_s"),  # connected, silent
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc", "body_timeout_s"),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", "body_timeout_s"),
    ],
)  # fmt: skip
def test_an_unfinished_head_or_body_gets_408_and_is_closed(sent: bytes, field: str) -> None:
    with serving(_plain_app) as port, _connect(port) as sock:
        sock.sendall(sent)
        status, error = _error(_read_until_closed(sock))
    assert status == 408 and error["type"] == "RequestTimeoutError"
    assert f"{field}=0.5 s" in error["message"]


def test_a_head_trickled_byte_by_byte_still_meets_its_deadline() -> None:
    """Bytes arriving do not extend the deadline: it is for the whole head."""
    with serving(_plain_app) as port, _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")
        deadline = time.monotonic() + WAIT_S
        while not select.select([sock], [], [], 0.05)[0]:
            assert time.monotonic() < deadline, "never closed"
            sock.sendall(b"X")  # a header name that never ends
        assert _error(_read_until_closed(sock))[0] == 408


def test_the_next_head_on_a_kept_alive_connection_has_a_deadline_too() -> None:
    with serving(_plain_app) as port, _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        first = b""
        while not first.endswith(b"\r\n\r\n2"):
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\nHost")
        assert _error(_read_until_closed(sock))[0] == 408


def test_a_slow_response_is_not_cut_by_the_deadlines() -> None:
    """While the application works on a request, the client rightly sends nothing."""

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(4 * LIMITS.header_timeout_s)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"late"})

    with serving(slow) as port:
        assert _get(port) == (200, b"late")


def test_requests_are_served_while_many_slow_connections_are_open() -> None:
    limits = TransportLimits(header_timeout_s=WAIT_S, body_timeout_s=WAIT_S)
    with serving(_plain_app, limits) as port:
        slow = [_connect(port) for _ in range(60)]
        try:
            for index, sock in enumerate(slow):
                if index % 2:
                    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                else:
                    sock.sendall(b"POST / HTTP/1.1\r\nContent-Length: 9\r\n\r\nabc")
            for _ in range(3):
                assert _get(port) == (200, b"0")
        finally:
            for sock in slow:
                sock.close()


def test_connections_beyond_max_connections_get_503_and_are_closed() -> None:
    cap = 20
    limits = TransportLimits(header_timeout_s=WAIT_S, body_timeout_s=WAIT_S, max_connections=cap)
    with serving(_plain_app, limits) as port:
        socks = [_connect(port) for _ in range(cap + 5)]
        try:
            refused: set[int] = set()
            deadline = time.monotonic() + WAIT_S
            while len(refused) < 5:
                assert time.monotonic() < deadline, f"only {len(refused)} refused"
                waiting = [sock for i, sock in enumerate(socks) if i not in refused]
                ready, _, _ = select.select(waiting, [], [], 0.1)
                for sock in ready:
                    status, error = _error(_read_until_closed(sock))
                    assert status == 503 and f"max_connections={cap}" in error["message"]
                    refused.add(socks.index(sock))
            assert len(refused) == 5
            socks[min(set(range(cap + 5)) - refused)].close()  # one slot free again
            deadline = time.monotonic() + WAIT_S
            while True:  # the server notices the close on its own time
                status, _ = _get(port)
                if status == 200:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            for sock in socks:
                sock.close()


def test_reserve_open_files_raises_the_soft_limit_or_refuses(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    assert reserve_open_files(1000) == 1000 + FD_HEADROOM
    assert calls == [(1000 + FD_HEADROOM, 4096)]
    calls.clear()
    assert reserve_open_files(900) == 1024 and calls == []
    with pytest.raises(ConfigError, match="max_connections: 4090 connections") as info:
        reserve_open_files(4090)
    assert "LimitNOFILE=" in str(info.value)


# -- big heads ----------------------------------------------------------------------------


def test_a_10_mb_header_line_is_refused_early_and_the_server_keeps_serving() -> None:
    with serving(_plain_app) as port, _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 10 * 1024 * 1024:
                sent += sock.send(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            reply = _read_until_closed(sock)
        except ConnectionResetError:
            reply = b""
        # the 431 may be lost to the reset a close with unread data sends
        assert reply == b"" or _error(reply)[0] == 431
        assert sent < 10 * 1024 * 1024, "the server read the whole line"
        assert _get(port) == (200, b"0")


def test_a_head_over_max_header_bytes_gets_431_naming_the_limit() -> None:
    with serving(_plain_app) as port, _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 9000)
        status, error = _error(_read_until_closed(sock))
    assert status == 431 and "max_header_bytes=8192" in error["message"]


def test_too_many_header_lines_get_431_and_a_head_within_the_limits_is_served() -> None:
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(30))
    with serving(_plain_app) as port:
        with _connect(port) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n" + lines + b"\r\n")
            status, error = _error(_read_until_closed(sock))
        assert status == 431 and "max_header_count=20" in error["message"]
        headers = {f"X-H{i}": "v" * 300 for i in range(15)}  # ~4.8 KB, 15 lines
        assert _get(port, headers=headers) == (200, b"0")


def test_a_client_that_reads_nothing_of_its_response_is_closed_and_the_app_told() -> None:
    """An endless response to a client that never reads: once the socket buffers are
    full, writing stays paused; after send_timeout_s the connection is dropped and the
    application's next receive says the client left (a stream's request is aborted)."""
    told = threading.Event()

    async def endless(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * 65536
        while True:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            try:
                message = await asyncio.wait_for(receive(), 0.001)
            except TimeoutError:
                continue
            if message["type"] == "http.disconnect":
                told.set()
                return

    with serving(endless) as port, _connect(port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert told.wait(WAIT_S), "the server kept writing to a client that reads nothing"


@pytest.mark.parametrize(
    "target", [b"http://[", b"http://a:99999/", b"http://a b/"], ids=["bracket", "port", "space"]
)
def test_an_invalid_request_target_gets_400_not_a_fatal_protocol_error(
    target: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn parses the URL in a parser callback: its failure is the client's, a 400
    and a close, never an error logged by the event loop."""
    with serving(_plain_app) as port:
        with _connect(port) as sock:
            sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            status, error = _error(_read_until_closed(sock))
        assert status == 400 and error["message"] == "invalid HTTP request"
        assert _get(port) == (200, b"0")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- the application: bodies, docs, metrics ------------------------------------------------


def _reply(model: str) -> MetricsReply:
    return MetricsReply(
        model=model,
        num_requests_running=0,
        num_requests_waiting=0,
        num_requests_swapped=0,
        kv_cache_usage_perc=0.0,
        cpu_swap_usage_perc=0.0,
        num_preemptions={},
        prompt_tokens=0,
        generation_tokens=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        request_success={},
        histograms={},
    )


class StubClient:
    """The scheduler client, as far as these tests reach: counts /metrics queries."""

    def __init__(self) -> None:
        self.metrics_calls = 0

    async def metrics(self, timeout: float | None = None) -> MetricsReply:
        self.metrics_calls += 1
        await asyncio.sleep(0.05)  # a scrape storm overlaps the query
        return _reply("stub")

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a refused request reached the scheduler")

    async def close(self) -> None:
        pass


class StubGateway(Gateway):
    def start(self) -> None:
        self.client = StubClient()  # type: ignore[assignment]


@pytest.fixture(scope="module")
def served_model(model: Path) -> ServedModel:
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
        {"bos_token": "<s>"},
    )
    return ServedModel(
        name="tiny",
        path=str(model),
        tokenizer=Tokenizer.from_file(str(model / "tokenizer.json")),
        chat_template=template,
        max_model_len=256,
    )


@contextmanager
def gateway_app(model: ServedModel, **settings: Any) -> Iterator[tuple[int, StubGateway]]:
    gateway = StubGateway(
        "ipc:///nowhere", GatewayConfig(**settings), api_key=settings.get("api_key")
    )
    gateway.model = model
    with serving(RawSend(create_app(gateway)), lifespan="on") as port:
        yield port, gateway


def _post(
    port: int, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    return post_json(local(port), path, body, headers, timeout=WAIT_S)


BIG = str(2**70)
INT64_OVER = str(2**63)
DEEP = "[" * 1200 + "]" * 1200
DEEPISH = "[" * 100 + "]" * 100
COMMON = [
    (f'"max_tokens": {BIG}', "max_tokens"),
    (f'"max_tokens": {INT64_OVER}', "max_tokens"),
    (f'"seed": {BIG}', "seed"),
    (f'"seed": -{BIG}', "seed"),
    (f'"n": {BIG}', "n"),
    (f'"top_k": {BIG}', "top_k"),
    (f'"min_tokens": {BIG}', "min_tokens"),
    (f'"priority": {BIG}', "priority"),
    (f'"priority": -{INT64_OVER}1', "priority"),
    (f'"best_of": {BIG}', "best_of"),
    (f'"stop_token_ids": [1, {BIG}]', "stop_token_ids"),
    (f'"stop_token_ids": [{INT64_OVER}]', "stop_token_ids"),
    (f'"unknown_field": {DEEP}', "unknown_field"),  # refused by name, before its value
    (f'"metadata": {DEEP}', None),  # accepted with no effect: its depth still counts
    (f'"user": {DEEP}', "user"),  # the type is checked before the depth
]
COMPLETION = [
    *((f'"prompt": "hi", {extra}', field) for extra, field in COMMON),
    (f'"prompt": "hi", "logprobs": {BIG}', "logprobs"),
    (f'"prompt": [1, 2, {BIG}]', "prompt"),
    (f'"prompt": [{INT64_OVER}]', "prompt"),
    (f'"prompt": [[1], [{BIG}]]', "prompt"),
    (f'"prompt": {DEEP}', None),
    (f'"prompt": {DEEPISH}', "prompt"),
]
MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'
CHAT = [
    *((f"{MESSAGES}, {extra}", field) for extra, field in COMMON),
    (f'{MESSAGES}, "logprobs": true, "top_logprobs": {BIG}', "top_logprobs"),
    (f'{MESSAGES}, "max_completion_tokens": {BIG}', "max_completion_tokens"),
    (f'"messages": [{{"role": "user", "content": "hi", "x": {DEEPISH}}}]', "messages"),
    (f'"messages": {DEEP}', "messages"),
    (f'"messages": [{{"role": "user", "content": "hi", "x": {DEEP}}}]', None),
    (f'{MESSAGES}, "chat_template_kwargs": {{"x": {DEEPISH}}}', "chat_template_kwargs"),
    (f'{MESSAGES}, "response_format": {{"type": {DEEPISH}}}', "response_format"),
    (f'{MESSAGES}, "tool_choice": {DEEPISH}', "tool_choice"),
]
TOKENIZE = [
    (f'"prompt": "hi", "x": {DEEP}', "x"),  # an unknown field, refused by name
    (f'"messages": [{{"role": "user", "content": {DEEPISH}}}]', "messages"),
    ('"messages": []', "messages"),  # as chat refuses them
    ('"messages": [{"role": "user", "content": "hi"}], "tools": [{"bad": 1}]', "tools"),
]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        *(("/v1/completions", fields, param) for fields, param in COMPLETION),
        *(("/v1/chat/completions", fields, param) for fields, param in CHAT),
        *(("/tokenize", fields, param) for fields, param in TOKENIZE),
        ("/detokenize", f'"tokens": [1, {BIG}]', "tokens"),
    ],
)
def test_hostile_bodies_get_400_naming_the_field(
    served_model: ServedModel, path: str, fields: str, param: str | None, caplog
) -> None:
    with gateway_app(served_model) as (port, _):
        status, body = _post(port, path, ("{" + fields + "}").encode())
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if param is None:
        assert "nested too deeply" in error["message"]
    else:
        assert error["param"] == param and error["message"].startswith(param), error
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"messages": "shadowed"},
        {"add_generation_prompt": {"a": 1}},
        {"bos_token": 5},
        {"bos_token": ["<s>"] * 3},
    ],
)
def test_chat_template_kwargs_shadowing_template_variables_are_a_400(
    served_model: ServedModel, kwargs: dict[str, Any], caplog
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    with gateway_app(served_model) as (port, _):
        status, reply = _post(port, "/v1/chat/completions", json.dumps(body).encode())
        tokenized = _post(
            port,
            "/tokenize",
            json.dumps({"messages": body["messages"], "chat_template_kwargs": kwargs}).encode(),
        )
    assert status == 400, reply
    assert reply["error"]["param"] == "chat_template_kwargs" or "template" in str(reply)
    # /tokenize takes no kwargs: refused by name, not ignored
    assert tokenized[0] == 400 and tokenized[1]["error"]["param"] == "chat_template_kwargs"
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_api_docs_are_off_by_default_and_need_the_key_when_on(served_model: ServedModel) -> None:
    with gateway_app(served_model) as (port, _):
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert _get(port, path)[0] == 404, path
    with gateway_app(served_model, api_docs=True, api_key="k3y") as (port, _):
        for path in ("/openapi.json", "/docs", "/redoc"):
            status, payload = _get(port, path)
            assert status == 401 and b"API key" in payload, path
            assert _get(port, path, {"authorization": "Bearer k3y"})[0] == 200, path
        schema = json.loads(_get(port, "/openapi.json", {"authorization": "Bearer k3y"})[1])
        assert "/v1/completions" in schema["paths"]


def test_a_metrics_storm_shares_one_scheduler_query(served_model: ServedModel) -> None:
    with gateway_app(served_model, metrics_interval_s=3600.0) as (port, gateway):
        client = gateway.client
        assert isinstance(client, StubClient)

        def scrape() -> tuple[int, bytes]:
            return _get(port, "/metrics")

        threads_out: list[tuple[int, bytes]] = []
        workers = [threading.Thread(target=lambda: threads_out.append(scrape())) for _ in range(40)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(WAIT_S)
        assert len(threads_out) == 40
        assert {status for status, _ in threads_out} == {200}
        assert len({payload for _, payload in threads_out}) == 1
        assert b"expeditor:num_requests_running{" in threads_out[0][1]
        assert client.metrics_calls == 1
        gateway.active += 1
        gateway.finished()  # a request through the gateway ended: counted by the next scrape
        assert scrape()[0] == 200 and client.metrics_calls == 2
        assert scrape()[0] == 200 and client.metrics_calls == 2


def test_metrics_cache_interval_and_errors() -> None:
    from expeditor.gateway.metrics import MetricsCache

    now = [0.0]
    calls = [0]
    failing = [False]

    async def fetch() -> MetricsReply:
        calls[0] += 1
        await asyncio.sleep(0)
        if failing[0]:
            raise RuntimeError("scheduler down")
        return _reply(f"m{calls[0]}")

    async def scenario() -> None:
        cache = MetricsCache(fetch, 1.0, clock=lambda: now[0])
        first = await asyncio.gather(*(cache.reply() for _ in range(10)))
        assert {r.model for r in first} == {"m1"} and calls[0] == 1
        now[0] = 0.9
        assert (await cache.reply()).model == "m1"
        now[0] = 1.0
        assert (await cache.reply()).model == "m2"
        failing[0] = True
        now[0] = 5.0
        results = await asyncio.gather(*(cache.reply() for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results) and calls[0] == 3
        failing[0] = False
        assert (await cache.reply()).model == "m4"  # a failure is not kept

    asyncio.run(scenario())


def test_example_config_lists_the_transport_limits() -> None:
    text = (REPO / "systemd" / "expeditor.toml").read_text()
    for field in (
        "header_timeout_s", "body_timeout_s", "max_header_bytes", "max_header_count",
        "max_connections", "metrics_interval_s", "api_docs",
    ):  # fmt: skip
        assert f"\n{field} = " in text, field


def test_expeditor_gateway_serves_with_these_limits(tmp_path: Path) -> None:
    """The real process (``expeditor gateway``, no scheduler needed for this): its
    connections are the guarded ones, configured from the flags."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "expeditor", "gateway",
            "--frontend", f"ipc://{tmp_path}/nowhere.sock", "--port", str(port),
            "--header-timeout-s", "0.5", "--max-header-bytes", "4096",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the gateway did not listen"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        with _connect(port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a")
            status, error = _error(_read_until_closed(sock))
            assert status == 408 and "header_timeout_s=0.5 s" in error["message"]
        with _connect(port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 5000)
            status, error = _error(_read_until_closed(sock))
            assert status == 431 and "max_header_bytes=4096" in error["message"]
        assert _get(port, "/openapi.json")[0] == 404
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_connection_cap_over_the_open_file_limit_refuses_to_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    too_many = 10**9 if hard == resource.RLIM_INFINITY else hard
    done = subprocess.run(
        [
            sys.executable, "-m", "expeditor", "gateway",
            "--frontend", f"ipc://{tmp_path}/nowhere.sock", "--port", "1",
            "--max-connections", str(too_many),
        ],
        capture_output=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    err = done.stderr.decode()
    assert f"max_connections: {too_many} connections need" in err and "LimitNOFILE=" in err
