"""What one HTTP request may cost the gateway (issue 29, items 2, 5, 6, 9, 10, 12): the
limits on batches, choices, response size, messages and template variables, rendering
bounded in size and time, batches started a few at a time, and a stream's unsent output
bounded. Units first, then end to end on a real ``expeditor serve --http``."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from functools import partial
from pathlib import Path

import pytest
from support.http import get, post_json
from support.idle import wait_idle
from support.serve import descendants_named, rss_mb, running_http_serve

from expeditor.gateway.chat import RESERVED_NAMES, ChatTemplate, render_messages
from expeditor.gateway.fanout import fan_out
from expeditor.gateway.limits import (
    check_batch,
    check_response_size,
    prompt_logprob_tokens,
    response_tokens,
)
from expeditor.gateway.protocol import GatewayRequestError
from expeditor.gateway.responses import DONE
from expeditor.gateway.stream_buffer import bounded_stream
from ipc.client import Client
from shared.gateway_config import GatewayConfig

# -- units ---------------------------------------------------------------------------------


def test_batch_and_choices_limits_name_their_setting() -> None:
    config = GatewayConfig(max_batch_prompts=4, max_batch_choices=8)
    check_batch(4, 2, config)
    with pytest.raises(GatewayRequestError, match="max_batch_prompts=4") as info:
        check_batch(5, 1, config)
    assert info.value.param == "prompt" and info.value.status == 400
    with pytest.raises(GatewayRequestError, match="max_batch_choices=8") as info:
        check_batch(3, 3, config)
    assert info.value.param == "n"


def test_response_estimate_counts_echo_choices_and_logprobs() -> None:
    assert response_tokens(2, [10, 20], 5, None) == 2 * (30 + 2 * 5)
    assert response_tokens(1, [0], 100, 3) == 100 * 5  # token, its logprob, 3 others
    # echo with logprobs: the echoed prompt's tokens come with theirs
    assert response_tokens(2, [10], 5, 3) == 2 * (10 + 5) * 5
    assert prompt_logprob_tokens([10, 20], 4) == 30 * 6
    assert prompt_logprob_tokens([10, 20], None) == 0
    assert response_tokens(1, [0], 5, None, 7) == 5 + 7
    config = GatewayConfig(max_response_tokens=1000)
    check_response_size(1000, config, "n")
    with pytest.raises(GatewayRequestError, match="max_response_tokens=1000") as info:
        check_response_size(1001, config, "n")
    assert info.value.param == "n"


def test_fan_out_starts_one_at_a_time_yielding_and_bounds_what_is_in_flight() -> None:
    async def scenario() -> tuple[list[int], list[int], int]:
        ticks = 0
        ticks_at_start: list[int] = []
        running = peak = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        async def work(index: int) -> int:
            nonlocal running, peak
            ticks_at_start.append(ticks)
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001)
            running -= 1
            return index * 10

        other = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        results = await fan_out(40, work, in_flight=8)
        other.cancel()
        return results, ticks_at_start, peak

    results, ticks_at_start, peak = asyncio.run(scenario())
    assert results == [i * 10 for i in range(40)]
    assert peak <= 8
    # The other task ran between every two starts (all started at once, it would not).
    assert all(b > a for a, b in itertools.pairwise(ticks_at_start))


def test_fan_out_failure_cancels_the_rest() -> None:
    cancelled = []

    async def work(index: int) -> int:
        if index == 3:
            raise ValueError("bad prompt")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(index)
            raise
        return index

    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(fan_out(10, work, in_flight=10))
    assert cancelled == [0, 1, 2]  # refused before the others started; those aborted


def test_a_stream_nobody_reads_is_closed_at_its_limit_and_ends_with_an_error() -> None:
    async def scenario() -> tuple[list[bytes], int]:
        closed = asyncio.Event()
        produced = 0

        async def source():
            nonlocal produced
            try:
                while True:
                    produced += 1
                    yield b"data: " + b"x" * 1000 + b"\n\n"
                    await asyncio.sleep(0)
            finally:
                closed.set()

        events = bounded_stream(source(), 65536, "test")
        first = await anext(events)  # then the reader stops reading
        await asyncio.wait_for(closed.wait(), 30)  # a hang guard, not a timing
        rest = [chunk async for chunk in events]
        return [first, *rest], produced

    chunks, produced = asyncio.run(scenario())
    assert produced < 100  # 65536 bytes of 1008-byte events, not an endless buffer
    tail = b"".join(chunks)
    assert tail.endswith(DONE)
    assert b"max_stream_buffer_bytes=65536" in tail.rsplit(b"data: ", 2)[-2]


def test_a_stream_failure_before_any_event_is_raised_to_its_reader() -> None:
    async def source():
        raise GatewayRequestError("refused")
        yield b""  # an async generator

    async def scenario() -> None:
        await anext(bounded_stream(source(), 65536, "test"))

    with pytest.raises(GatewayRequestError, match="refused"):
        asyncio.run(scenario())


LLAMA2_TEMPLATE = (
    "{% for message in messages %}{{ bos_token }}[INST] {{ message['content'] }} [/INST]"
    "{% endfor %}"
)


@pytest.mark.parametrize("key", sorted(RESERVED_NAMES))
def test_template_kwargs_cannot_shadow_the_templates_variables(key: str) -> None:
    template = ChatTemplate(LLAMA2_TEMPLATE, {"bos_token": "<s>"})
    with pytest.raises(GatewayRequestError, match=repr(key)) as info:
        template.render([{"role": "user", "content": "hi"}], extra={key: "x" * 1000})
    assert info.value.param == "chat_template_kwargs"
    # Other variables are the template's business (vLLM's enable_thinking and the like).
    text = template.render([{"role": "user", "content": "hi"}], extra={"enable_thinking": True})
    assert text == "<s>[INST] hi [/INST]"


def test_render_limits_messages_size_and_time() -> None:
    template = ChatTemplate(LLAMA2_TEMPLATE, {"bos_token": "<s>"})
    messages = [{"role": "user", "content": "y" * 100}] * 50

    def render(**limits: float) -> str:
        kwargs = {"max_messages": 100, "max_bytes": 1 << 20, "timeout_s": 30.0, **limits}
        return asyncio.run(render_messages(template, messages, **kwargs))  # type: ignore[arg-type]

    assert render().count("[INST]") == 50
    with pytest.raises(GatewayRequestError, match="max_messages=49"):
        render(max_messages=49)
    with pytest.raises(GatewayRequestError, match="max_prompt_bytes=2000"):
        render(max_bytes=2000)
    with pytest.raises(GatewayRequestError, match="render_timeout_s=1e-09"):
        render(timeout_s=1e-9)


def test_a_template_failing_on_request_values_is_a_400() -> None:
    template = ChatTemplate("{{ messages | length + depth }}", {})
    with pytest.raises(GatewayRequestError, match="chat template failed") as info:
        template.render([{"role": "user", "content": "x"}], extra={"depth": "deep"})
    assert info.value.status == 400


# -- end to end ----------------------------------------------------------------------------


STREAM_LIMIT = 65536


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("limits")
    template = root / "llama2.jinja"
    template.write_text(LLAMA2_TEMPLATE)
    config = root / "expeditor.toml"
    config.write_text(f"[gateway]\nmax_stream_buffer_bytes = {STREAM_LIMIT}\n")
    flags = (
        "--config", str(config),
        "--chat-template", str(template), "--num-gpu-blocks", "2048",
        "--max-model-len", "256", "--max-num-seqs", "256",
    )  # fmt: skip
    with running_http_serve(model, *flags) as served:
        yield served


_post = partial(post_json, timeout=120)


def _gateway_pid(serve_pid: int) -> int:
    """The gateway process under ``serve`` (a descendant whose command names it)."""
    found = descendants_named(serve_pid, b"gateway")
    assert len(found) == 1, found
    return found[0]


def test_a_100k_prompt_batch_is_refused_naming_the_limit(served) -> None:
    status, body = _post(served[1], "/v1/completions", {"prompt": [[65]] * 100_000})
    assert status == 400, body
    assert "max_batch_prompts=256" in body["error"]["message"]
    assert body["error"]["param"] == "prompt"
    status, body = _post(served[1], "/v1/completions", {"prompt": [[65]] * 100, "n": 11})
    assert status == 400 and "max_batch_choices=1024" in body["error"]["message"]


def test_normal_users_finish_while_a_max_size_batch_is_served(served) -> None:
    frontend, url, _ = served

    async def scenario() -> tuple[tuple[int, dict], list[tuple[int, dict]]]:
        batch = asyncio.to_thread(
            _post,
            url,
            "/v1/completions",
            {"prompt": [[1, 65 + i % 50, 66] for i in range(256)], "max_tokens": 8},
        )
        users = [
            asyncio.to_thread(
                _post, url, "/v1/completions", {"prompt": [1, 70 + i], "max_tokens": 4}
            )
            for i in range(8)
        ]
        big, *small = await asyncio.gather(batch, *users)
        return big, small

    big, small = asyncio.run(scenario())
    assert big[0] == 200 and len(big[1]["choices"]) == 256
    assert [s for s, _ in small] == [200] * 8
    assert all(b["usage"]["completion_tokens"] == 4 for _, b in small)
    wait_idle(frontend)


def test_echo_amplification_is_refused_before_any_work(served) -> None:
    body = {"prompt": [[1, *range(3, 1103)]] * 256, "n": 4, "max_tokens": 0, "echo": True}
    status, reply = _post(served[1], "/v1/completions", body)
    assert status == 400, reply
    assert "max_response_tokens=1048576" in reply["error"]["message"]
    # Many long samples with logprobs (item 12): the same limit.
    body = {"prompt": [1, 5], "n": 64, "max_tokens": 1900, "logprobs": 20}
    status, reply = _post(served[1], "/v1/completions", body)
    assert status == 400 and "max_response_tokens" in reply["error"]["message"]


def test_chat_template_abuse_is_refused_and_others_keep_flowing(served) -> None:
    url = served[1]
    messages = [{"role": "user", "content": "hello"}] * 1000
    override = {"messages": messages, "chat_template_kwargs": {"bos_token": "B" * 3000}}
    status, reply = _post(url, "/v1/chat/completions", override)
    assert status == 400 and reply["error"]["param"] == "chat_template_kwargs", reply
    assert "'bos_token'" in reply["error"]["message"]
    huge = {"messages": [{"role": "user", "content": "z" * 1500}] * 900, "max_tokens": 2}
    status, reply = _post(url, "/v1/chat/completions", huge)
    assert status == 400 and "max_prompt_bytes=1048576" in reply["error"]["message"], reply
    many = {"messages": [{"role": "user", "content": "m"}] * 2049}
    status, reply = _post(url, "/v1/chat/completions", many)
    assert status == 400 and "max_messages=2048" in reply["error"]["message"], reply
    fine = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, reply = _post(url, "/v1/chat/completions", fine)
    assert status == 200 and reply["usage"]["completion_tokens"] <= 3


def test_a_stream_its_client_never_reads_is_aborted_and_memory_stays_bounded(served) -> None:
    frontend, url, proc = served
    gateway = _gateway_pid(proc.pid)
    rss_before = rss_mb(gateway)
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    body = json.dumps(
        {"prompt": [1, 5, 6], "n": 64, "max_tokens": 250, "logprobs": 2, "stream": True}
        | {"ignore_eos": True}
    ).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    # Never read: the request must stop on the scheduler long before its 16,000 tokens.
    with Client(frontend, timeout=10) as client:
        deadline = time.monotonic() + 60
        while not client.inspect().snapshot.seqs:  # running
            assert time.monotonic() < deadline
            time.sleep(0.02)
    wait_idle(frontend)
    status, payload = get(url, "/metrics", timeout=30)
    metrics = payload.decode()
    assert status == 200
    generated = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("expeditor:generation_tokens_total")
    ]
    aborted = [
        line
        for line in metrics.splitlines()
        if 'finished_reason="abort"' in line and "total" in line
    ]
    assert aborted and float(aborted[0].split()[-1]) >= 1, aborted
    assert generated and generated[0] < 64 * 250
    assert rss_mb(gateway) < rss_before + 100
    # A client that reads after all gets the error event and [DONE] (chunked).
    got = b""
    while not got.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(1 << 16)
        assert chunk, got[-300:]
        got += chunk
    sock.close()
    assert b"data: [DONE]\n\n" in got[-100:]
    assert f"max_stream_buffer_bytes={STREAM_LIMIT}".encode() in got[-1000:]


def test_memory_of_large_refused_requests_is_handed_back(served) -> None:
    """Item 9: 20 concurrent chats of 100k messages, all refused (max_messages)."""
    url, proc = served[1], served[2]
    gateway = _gateway_pid(proc.pid)
    body = {"messages": [{"role": "user", "content": "x"}] * 100_000}

    async def flood() -> list[tuple[int, dict]]:
        return await asyncio.gather(
            *(asyncio.to_thread(_post, url, "/v1/chat/completions", body) for _ in range(20))
        )

    before = rss_mb(gateway)
    replies = asyncio.run(flood())
    assert all(s == 400 and "max_messages" in r["error"]["message"] for s, r in replies)
    deadline = time.monotonic() + 30  # the trim runs on a thread once they are over
    while rss_mb(gateway) > before + 150:
        assert time.monotonic() < deadline, (before, rss_mb(gateway))
        time.sleep(0.2)
