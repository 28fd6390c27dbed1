"""End to end through HTTP: real `expeditor serve --http` processes on the tiny model,
driven by the official openai client (sync and async), raw HTTP and the ZeroMQ client;
greedy outputs checked against transformers and the ZeroMQ path."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.hf_reference import Oracle, hf_prompt_log_softmax
from support.http import get, local, post, post_json
from support.idle import wait_idle
from support.serve import running_http_serve
from tokenizers import Tokenizer

from ipc.client import Client
from scheduler_svc.launch import free_port

MAX_TOKENS = 12
PROMPTS = [
    [1, 72, 101, 108, 108, 111],
    [1, *range(40, 80)],
    [1, 200, 17, 33, 250, 9, 9, 9, 120],
]


_post = partial(post, timeout=30)
"""(status, headers, body bytes) of a raw HTTP POST."""
_get = partial(get, timeout=30)


@pytest.fixture(scope="module")
def expected(model: Path, hf_oracle: Oracle) -> list[list[int]]:
    return hf_oracle(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(model: Path):
    with running_http_serve(model, "--num-gpu-blocks", "128", "--max-model-len", "256") as served:
        yield served


@pytest.fixture(scope="module")
def sync_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(sync_client: openai.OpenAI) -> str:
    return sync_client.models.list().data[0].id


def _metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics as 'name{label=value,...}' -> value."""
    status, payload = _get(url, "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(payload.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _one(samples: dict[str, float], prefix: str) -> float:
    found = [v for k, v in samples.items() if k.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return found[0]


# -- outputs -----------------------------------------------------------------------------


def test_greedy_completions_equal_transformers_and_the_zmq_client(
    server, sync_client, model_name, expected, model
) -> None:
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    with Client(server[0], timeout=60) as zmq_client:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            reply = sync_client.completions.create(
                model=model_name,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=0,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )
            choice = reply.choices[0]
            assert choice.logprobs.tokens == [f"token_id:{t}" for t in want]
            assert choice.text == tokenizer.decode(want, skip_special_tokens=True)
            assert choice.finish_reason == "length"
            assert reply.usage.prompt_tokens == len(prompt)
            assert reply.usage.completion_tokens == MAX_TOKENS
            assert reply.usage.total_tokens == len(prompt) + MAX_TOKENS
            direct = zmq_client.generate(
                prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
            )
            assert direct.token_ids == want
            assert direct.text == choice.text


def test_streamed_chat_equals_non_streamed_and_reports_usage(sync_client, model_name) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    whole = sync_client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        sync_client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # The same conversation again: its prompt's full blocks come from the prefix cache.
    assert last.usage.prompt_tokens_details.cached_tokens >= 16
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_n2_seed_logprobs_and_stop(server, model_name, expected, model) -> None:
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    greedy_text = tokenizer.decode(expected[1], skip_special_tokens=True)

    async def scenario():
        client = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model=model_name, prompt="Once upon", max_tokens=8, temperature=1.0)
        first, second, other = await asyncio.gather(
            client.completions.create(**kwargs, n=2, seed=7),
            client.completions.create(**kwargs, n=2, seed=7),
            client.completions.create(**kwargs, n=2, seed=8),
        )
        chat = await client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
        # A stop string taken from the greedy output ends the text just before it.
        stop = greedy_text[5:8]
        stopped = await client.completions.create(
            model=model_name,
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        await client.close()
        return first, second, other, chat, stopped, stop

    first, second, other, chat, stopped, stop = asyncio.run(scenario())
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert [c.text for c in first.choices] != [c.text for c in other.choices]
    assert first.usage.completion_tokens == 16  # both samples, 8 tokens each
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert entry.logprob == ranked[0]  # greedy: the sampled token is the most likely
        assert entry.bytes == list(entry.token.encode())
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy_text[: greedy_text.find(stop)]
    assert stopped.choices[0].stop_reason == stop  # vLLM's field: what stopped it


def test_async_streams_of_n2_equal_the_whole_answers(server, model_name) -> None:
    async def scenario():
        client = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model=model_name, prompt=[1, 50, 60, 70], max_tokens=9, temperature=0.7,
                      seed=11, n=2, extra_body={"ignore_eos": True})  # fmt: skip
        whole = await client.completions.create(**kwargs)
        texts = ["", ""]
        chunks = []
        async for chunk in await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        ):
            chunks.append(chunk)
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        chat = [
            c
            async for c in await client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                stream=True,
            )
        ]  # fmt: skip
        await client.close()
        return whole, texts, chunks, chat

    whole, texts, chunks, chat = asyncio.run(scenario())
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage == whole.usage
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("length", "stop")


def test_echo_and_prompt_batches(sync_client, model_name) -> None:
    reply = sync_client.completions.create(
        model=model_name, prompt=["Alpha", "Beta"], max_tokens=3, temperature=0, echo=True, n=2
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text.startswith("Alpha") and reply.choices[2].text.startswith("Beta")
    assert reply.choices[0].text == reply.choices[1].text  # greedy samples agree
    assert reply.usage.completion_tokens == 4 * 3


def test_max_tokens_zero_answers_without_generating(sync_client, model_name, model) -> None:
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    reply = sync_client.completions.create(
        model=model_name, prompt="Score me", max_tokens=0, echo=True
    )
    assert reply.choices[0].text == "Score me" and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(tokenizer.encode("Score me").ids)
    assert reply.usage.completion_tokens == 0
    chunks = list(
        sync_client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens > 3
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        sync_client.completions.create(model=model_name, prompt="x", max_tokens=0,
                                       extra_body={"min_tokens": 1})  # fmt: skip


# -- the SSE wire format -------------------------------------------------------------------


def _events(payload: bytes) -> list[dict]:
    """The JSON bodies of an SSE response (before ``[DONE]``)."""
    events = payload.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    return [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]


def test_echo_with_logprobs_and_prompt_logprobs_equal_transformers(
    server, model_name, model
) -> None:
    """Completions with echo and logprobs list the prompt's tokens with their logprobs
    (the first ``null``), then the sample's; max_tokens 0 scores the prompt alone;
    vLLM's ``prompt_logprobs`` (completions and chat, whole and streamed) give each
    position's token, rank and top tokens. Values equal transformers' log-softmax; a
    request for them reports no prefix-cache hit even for a prompt served before."""
    prompt = PROMPTS[1]
    (ref,) = hf_prompt_log_softmax(model, [prompt])
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    url = server[1]
    base = {"model": model_name, "prompt": prompt, "temperature": 0}
    status, plain = post_json(url, "/v1/completions", {**base, "max_tokens": 3, "logprobs": 2},
                              timeout=30)  # fmt: skip
    assert status == 200
    status, echoed = post_json(
        url, "/v1/completions", {**base, "max_tokens": 3, "logprobs": 2, "echo": True}, timeout=30
    )
    assert status == 200
    choice = echoed["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])  # 2 best and the token
    generated = plain["choices"][0]["logprobs"]
    # (the plain request read the cache: its sums differ in the last bits)
    assert lp["token_logprobs"][len(prompt) :] == pytest.approx(
        generated["token_logprobs"], abs=1e-4
    )
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"].endswith(plain["choices"][0]["text"])
    assert echoed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # served before
    status, again = post_json(url, "/v1/completions", {**base, "max_tokens": 1}, timeout=30)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # it was cached
    # scoring: nothing generated
    status, scored = post_json(
        url, "/v1/completions", {**base, "max_tokens": 0, "logprobs": 0, "echo": True}, timeout=30
    )
    assert status == 200 and scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    assert len(scored["choices"][0]["logprobs"]["tokens"]) == len(prompt)
    # vLLM's prompt_logprobs, on a completion and streamed (on the first chunk)
    body = {**base, "max_tokens": 2, "prompt_logprobs": 3}
    status, whole = post_json(url, "/v1/completions", body, timeout=30)
    assert status == 200
    listed = whole["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(prompt)
    for position in range(1, len(prompt)):
        entry = listed[position][str(prompt[position])]
        row = ref[position - 1]
        assert entry["logprob"] == pytest.approx(want[position - 1], abs=1e-4)
        assert entry["rank"] == int((row > row[prompt[position]]).sum()) + 1
        best = row.topk(3).indices.tolist()
        assert {str(t) for t in best} <= set(listed[position])
        assert all(listed[position][str(t)]["rank"] == r for r, t in enumerate(best, start=1))
    status, _, payload = _post(url, "/v1/completions", {**body, "stream": True})
    chunks = _events(payload)
    assert chunks[0]["choices"][0]["prompt_logprobs"] == listed
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])
    stream = {**base, "max_tokens": 3, "logprobs": 2, "echo": True, "stream": True}
    status, _, payload = _post(url, "/v1/completions", stream)
    streamed = [t for c in _events(payload) for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    # chat: once, at the top level (streamed: on the first chunk after the opening)
    chat = {"model": model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "prompt_logprobs": 1}  # fmt: skip
    status, reply = post_json(url, "/v1/chat/completions", chat, timeout=30)
    assert status == 200
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
    assert reply["prompt_logprobs"][0] is None
    status, _, payload = _post(url, "/v1/chat/completions", {**chat, "stream": True})
    chunks = _events(payload)
    assert [c.get("prompt_logprobs") is not None for c in chunks].count(True) == 1
    assert (
        next(c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c)
        == reply["prompt_logprobs"]
    )


def test_raw_sse_bytes(server, model_name) -> None:
    status, headers, payload = _post(
        server[1],
        "/v1/completions",
        {
            "model": model_name,
            "prompt": [1, 5, 6, 7],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert payload.endswith(b"\n\ndata: [DONE]\n\n")
    events = payload.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    bodies = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert all(b["object"] == "text_completion" for b in bodies)
    assert len({b["id"] for b in bodies}) == 1 and bodies[0]["id"].startswith("cmpl-")
    assert bodies[-1] == {
        "id": bodies[0]["id"],
        "object": "text_completion",
        "created": bodies[0]["created"],
        "model": model_name,
        "choices": [],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 5,
            "total_tokens": 9,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert bodies[-2]["choices"][0]["finish_reason"] == "length"
    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    status, _, payload = _post(
        server[1],
        "/v1/completions",
        {"model": model_name, "prompt": [1, 5, 6, 7], "max_tokens": 5, "temperature": 0,
         "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )  # fmt: skip
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in payload.split(b"\n\n")[:-2]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 2
    assert all(c["usage"]["prompt_tokens"] == 4 for c in chunks)


# -- disconnects -----------------------------------------------------------------------------


def _send_completion(url: str, body: dict) -> socket.socket:
    """A socket on which a POST /v1/completions of ``body`` was sent, for tests that
    read part of the answer or hang up."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _disconnect_after(url: str, body: dict, read_bytes: int) -> bytes:
    sock = _send_completion(url, body)
    got = b""
    while len(got) < read_bytes:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        got += chunk
    sock.close()
    return got


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request_and_frees_its_blocks(
    server, model_name, stream
) -> None:
    frontend, url, _ = server
    before = _one(_metrics(url), "expeditor:request_success_total{finished_reason=abort")
    body = {
        "model": model_name,
        "prompt": [1, *range(10, 100)],
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": stream,
    }
    with Client(frontend, timeout=10) as client:
        if stream:
            got = _disconnect_after(url, body, 1)  # headers at least: it is running
            assert got.startswith(b"HTTP/1.1 200")
        else:
            sock = _send_completion(url, body)
            deadline = time.monotonic() + 20
            while not (client.inspect().snapshot.seqs):  # running on the scheduler
                assert time.monotonic() < deadline
                time.sleep(0.02)
            sock.close()
    wait_idle(frontend)
    after = _one(_metrics(url), "expeditor:request_success_total{finished_reason=abort")
    assert after == before + 1


# -- errors -----------------------------------------------------------------------------------


def _error(status_body: tuple[int, dict, bytes]) -> tuple[int, dict]:
    status, headers, payload = status_body
    assert headers["content-type"] == "application/json"
    body = json.loads(payload)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return status, body["error"]


def test_bad_requests_name_the_field(server, model_name) -> None:
    url = server[1]
    cases = [
        ({"model": model_name, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"model": model_name, "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": model_name, "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": model_name, "prompt": "x", "n": 0}, "n"),
        ({"model": model_name, "prompt": "x", "logprobs": 50}, "logprobs"),
        ({"model": model_name, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": model_name, "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": model_name, "prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"model": model_name, "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"model": model_name, "prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"model": model_name, "prompt": "x", "min_p": 2}, "min_p"),
        ({"model": model_name, "prompt": "x", "guided_regex": 5}, "guided_regex"),
        ({"model": model_name, "prompt": "x", "response_format": {"type": "xml"}},
         "response_format"),
        ({"model": model_name, "prompt": "x", "no_such_field": 1}, "no_such_field"),
        ({"model": model_name, "prompt": "x", "num_speculative_tokens": 17},
         "num_speculative_tokens"),
        ({"model": model_name, "prompt": "x", "num_speculative_tokens": 2,
          "response_format": {"type": "json_object"}}, "num_speculative_tokens"),
        ({"model": model_name, "prompt": [[1, 2], 3]}, "prompt"),
        ({"model": model_name}, "prompt"),
        ({"model": model_name, "prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),
    ]  # fmt: skip
    for body, field in cases:
        status, error = _error(_post(url, "/v1/completions", body))
        assert status == 400, (body, error)
        assert error["param"] == field and error["message"].startswith(field), (body, error)
    status, error = _error(
        _post(url, "/v1/chat/completions", {"model": model_name, "messages": [], "n": 1})
    )
    assert (status, error["param"]) == (400, "messages")
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    status, error = _error(
        _post(
            url,
            "/v1/chat/completions",
            {"model": model_name, "messages": [{"role": "user", "content": [image]}]},
        )
    )
    assert status == 400 and "only text parts" in error["message"]
    status, error = _error(_post(url, "/v1/completions", b"{not json"))
    assert status == 400 and "not valid JSON" in error["message"]
    # Prompts the gateway renders and tokenizes itself keep the scheduler's byte limit.
    huge = [{"role": "user", "content": "x" * (1024 * 1024 + 1)}]
    status, error = _error(
        _post(url, "/v1/chat/completions", {"model": model_name, "messages": huge})
    )
    assert status == 400 and error["param"] == "messages"
    assert "max_prompt_bytes=1048576" in error["message"]
    status, error = _error(_post(url, "/tokenize", {"messages": huge}))
    assert status == 400 and error["param"] == "messages"
    # The scheduler's own refusals: a prompt beyond max_model_len, ids outside the vocab.
    status, error = _error(
        _post(url, "/v1/completions", {"model": model_name, "prompt": [5] * 300})
    )
    assert status == 400 and "max_model_len" in error["message"]
    status, error = _error(
        _post(url, "/v1/completions", {"model": model_name, "prompt": [1, 10**6]})
    )
    assert status == 400 and "vocab" in error["message"] and error["param"] == "prompt"
    body = {"model": model_name, "prompt": "x", "num_speculative_tokens": 2}
    status, error = _error(_post(url, "/v1/completions", body))
    assert status == 400 and error["param"] == "num_speculative_tokens"
    assert error["message"].startswith(
        "num_speculative_tokens: 2 exceeds the server's num_speculative_tokens (0; "
    )
    for field, value in (("logit_bias", {"1000000": 1.0}), ("allowed_token_ids", [10**6])):
        body = {"model": model_name, "prompt": "x", field: value}
        status, error = _error(_post(url, "/v1/completions", body))
        assert status == 400 and error["message"].startswith(f"{field}: token id 1000000")


def test_unknown_model_and_route_are_404(server) -> None:
    status, error = _error(_post(server[1], "/v1/completions", {"model": "gpt-9", "prompt": "x"}))
    assert status == 404 and error["param"] == "model" and "gpt-9" in error["message"]
    status, error = _error(_post(server[1], "/v1/nothing", {}))
    assert status == 404


def test_tokenize_detokenize_models_health(server, model_name, model) -> None:
    url = server[1]
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    status, _, payload = _post(url, "/tokenize", {"prompt": "Hello there"})
    body = json.loads(payload)
    assert status == 200
    assert body["tokens"] == tokenizer.encode("Hello there").ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    status, _, payload = _post(url, "/detokenize", {"tokens": body["tokens"][1:]})
    assert (status, json.loads(payload)) == (200, {"prompt": "Hello there"})
    status, _, payload = _post(url, "/tokenize", {"messages": [{"role": "user", "content": "A"}]})
    assert status == 200 and json.loads(payload)["count"] > 3
    status, error = _error(_post(url, "/detokenize", {"tokens": [10**7]}))
    assert status == 400 and error["param"] == "tokens"
    status, payload = _get(url, "/v1/models")
    card = json.loads(payload)["data"][0]
    assert card["id"] == model_name == str(model) and card["max_model_len"] == 256
    status, payload = _get(url, "/health")
    assert status == 200 and json.loads(payload)["workers_ready"] == 1


# -- metrics ---------------------------------------------------------------------------------


def test_metrics_move_with_traffic_from_http_and_zmq(server, sync_client, model_name) -> None:
    frontend, url, _ = server
    wait_idle(frontend)
    names = {f.name for f in text_string_to_metric_families(_get(url, "/metrics")[1].decode())}
    for name in (
        "num_requests_running", "num_requests_waiting", "num_requests_swapped",
        "kv_cache_usage_perc", "cpu_swap_usage_perc", "num_preemptions",
        "num_preemptions_by_mode", "prompt_tokens", "generation_tokens",
        "prefix_cache_queries", "prefix_cache_hits", "request_success",
        "prefix_cache_host_hits", "prefix_cache_host_demoted_blocks",
        "time_to_first_token_seconds", "inter_token_latency_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds", "iteration_tokens_total",
    ):  # fmt: skip
        assert f"expeditor:{name}" in names, name
    before = _metrics(url)
    label = f"{{model_name={model_name}}}"
    sync_client.completions.create(
        model=model_name, prompt=[1, 2, 3, 4], max_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    with Client(frontend, timeout=30) as client:
        client.generate(prompt_token_ids=[1, 9, 9, 9, 9], max_tokens=5, ignore_eos=True)
    after = _metrics(url)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved(f"expeditor:generation_tokens_total{label}") == 12
    assert moved(f"expeditor:prompt_tokens_total{label}") == 9
    assert moved(f"expeditor:prefix_cache_queries_total{label}") == 9
    assert (
        moved(f"expeditor:request_success_total{{finished_reason=length,model_name={model_name}}}")
        == 2
    )
    assert moved(f"expeditor:time_to_first_token_seconds_count{label}") == 2
    assert moved(f"expeditor:e2e_request_latency_seconds_count{label}") == 2
    assert moved(f"expeditor:inter_token_latency_seconds_count{label}") == 6 + 4
    assert moved(f"expeditor:iteration_tokens_total_sum{label}") >= 9 + 12 - 2
    inf = f"expeditor:time_to_first_token_seconds_bucket{{le=+Inf,model_name={model_name}}}"
    assert after[inf] == after[f"expeditor:time_to_first_token_seconds_count{label}"]
    assert after[f"expeditor:kv_cache_usage_perc{label}"] == 0.0
    assert after[f"expeditor:num_requests_running{label}"] == 0


# -- a second server: API key, limits, overload, shutdown ---------------------------------


@contextmanager
def _guarded_serve(
    model: Path, key_dir: Path
) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    key_file = key_dir / "api_key"
    key_file.write_text("s3cret\n")
    flags = (
        "--api-key-file", str(key_file),
        "--max-body-bytes", "2048", "--max-num-seqs", "1", "--max-waiting-requests", "1",
        "--num-gpu-blocks", "64",
    )  # fmt: skip
    with running_http_serve(model, *flags) as served:
        yield served


@pytest.fixture(scope="module")
def guarded(model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Shared by the module's tests, in whatever order they run: none may stop it."""
    with _guarded_serve(model, tmp_path_factory.mktemp("key")) as served:
        yield served


@pytest.fixture
def guarded_alone(model: Path, tmp_path: Path):
    """A guarded server of its own, for a test that shuts it down."""
    with _guarded_serve(model, tmp_path) as served:
        yield served


AUTH = {"authorization": "Bearer s3cret"}


def test_api_key_is_required_except_for_health_and_metrics(guarded) -> None:
    url = guarded[1]
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        status, error = _error(_post(url, "/v1/completions", {"prompt": "x"}, headers))
        assert status == 401 and error["type"] == "AuthenticationError", headers
    status, _, payload = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2}, AUTH)
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 2
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    assert client.models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert _get(url, "/health")[0] == 200 and _get(url, "/metrics")[0] == 200


def test_body_over_the_limit_is_413(guarded) -> None:
    status, error = _error(_post(guarded[1], "/v1/completions", {"prompt": "x" * 4000}, AUTH))
    assert status == 413 and "max_body_bytes=2048" in error["message"]


def test_a_full_queue_answers_429_overloaded(guarded) -> None:
    url = guarded[1]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)

    async def flood():
        calls = [
            client.completions.create(
                model=None, prompt=[1, 2, 3], max_tokens=40, extra_body={"ignore_eos": True}
            )
            for _ in range(6)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        await client.close()
        return results

    results = asyncio.run(flood())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert refused and served and len(refused) + len(served) == 6, results
    assert all(r.body["type"] == "overloaded" for r in refused)
    wait_idle(guarded[0])


def _gateway(
    frontend: str, *flags: str, stderr: IO[bytes] | int
) -> tuple[subprocess.Popen[bytes], str]:
    """``expeditor gateway`` alone, in front of ``frontend``, on a free port: (the
    process, its URL)."""
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "expeditor", "gateway", "--frontend", frontend, "--port",
         str(port), *flags],
        stdout=subprocess.DEVNULL, stderr=stderr,
    )  # fmt: skip
    return gateway, local(port)


def test_a_gateway_stopped_alone_ends_open_streams_with_an_error_event(guarded, tmp_path) -> None:
    """SIGTERM to a gateway with a stream open: after its grace (shutdown_timeout_s) the
    stream ends with an error event and [DONE], the scheduler request is aborted, and the
    gateway exits 0 without a traceback."""
    frontend = guarded[0]  # its scheduler, through a second gateway of its own
    log = tmp_path / "gateway.log"
    with log.open("wb") as err:
        gateway, url = _gateway(frontend, "--shutdown-timeout-s", "0.2", stderr=err)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(url, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and gateway.poll() is None
            time.sleep(0.1)
        # 1000 decode steps of one sequence: still running when the 0.2 s grace ends.
        body = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        sock = _send_completion(url, body)
        got = sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
        gateway.send_signal(signal.SIGTERM)
        while chunk := sock.recv(65536):
            got += chunk
        sock.close()
        assert gateway.wait(timeout=30) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
    assert b'"message": "the gateway is shutting down"' in got
    assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the last event, then the end
    assert b"Traceback" not in log.read_bytes()
    wait_idle(frontend)


def test_shutting_down_answers_503_and_requests_in_flight_finish(guarded_alone) -> None:
    _, url, proc = guarded_alone
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    name = client.models.list().data[0].id
    stream = client.completions.create(
        model=name, prompt=[1, 2], max_tokens=900, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert first.choices
    # 900 decode steps of one sequence: the drain lasts long enough for the polls below
    # to meet it (a drain over before the first poll leaves it to a scheduler gone).
    proc.send_signal(signal.SIGTERM)  # serve drains the scheduler first
    deadline = time.monotonic() + 20
    while True:
        status, _, payload = _post(url, "/v1/completions", {"prompt": "x"}, AUTH)
        if status == 503:
            break
        assert time.monotonic() < deadline, (status, payload)
        time.sleep(0.05)
    error = json.loads(payload)["error"]
    assert "shutting down" in error["message"]
    rest = list(stream)  # the request in flight still ends normally
    assert rest[-1].choices[0].finish_reason == "length"
    assert proc.wait(timeout=60) == 0


# -- no worker -------------------------------------------------------------------------------


def test_without_a_worker_health_and_requests_answer_503(tmp_path: Path) -> None:
    frontend = f"ipc://{tmp_path}/f.sock"
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "expeditor", "scheduler", "--frontend", frontend,
         "--worker-endpoint", f"ipc://{tmp_path}/w.sock"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    gateway, url = _gateway(frontend, "--scheduler-timeout-s", "2", stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, payload = _get(url, "/health")
                break
            except OSError:
                assert time.monotonic() < deadline and gateway.poll() is None
                time.sleep(0.1)
        assert status == 503 and json.loads(payload)["status"] == "starting"
        status, error = _error(_post(url, "/v1/completions", {"prompt": "x"}))
        assert status == 503 and "no worker" in error["message"]
        scheduler.terminate()
        scheduler.wait(timeout=30)
        # The scheduler is gone: health says so once the gateway's client gives up.
        deadline = time.monotonic() + 30
        while _get(url, "/health")[0] != 503 or b"does not answer" not in _get(url, "/health")[1]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        for proc in (gateway, scheduler):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
