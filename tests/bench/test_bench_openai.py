"""``expeditor bench --target openai:URL`` against stub OpenAI-compatible servers.

Each stub is an aiohttp.web app on 127.0.0.1 (port 0) in a thread of its own; it records
every request it receives and streams server-sent events in one of several styles:

- ``vllm``: one event per token (after a role-only event in chat), a keep-alive comment,
  a ``choices: []`` event with usage, then ``data: [DONE]``;
- ``hf``: ``\\r\\n`` line ends, two tokens per event, usage on the last content event
  (with ``finish_reason``), no ``[DONE]`` (the body just ends);
- ``error``: one event, then an error event (``{"error": {...}}``);
- ``broken``: two events, then the connection is cut mid-body.

``cap`` makes the stub stop early (as at EOS); ``fail_every`` answers every n-th request
with HTTP 503; ``hold`` keeps each stream waiting until that many are in flight (for at
most ``hold_s`` seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tokenizers import Tokenizer
from typer.testing import CliRunner

from expeditor.bench.openai_target import SSEDecoder, StreamRecord
from expeditor.bench.run import parse_target, run_bench, target_config
from expeditor.bench.targets import TargetError
from expeditor.bench.workloads import BenchRequest, Workload, skewed
from expeditor.cli import app

STUB_MODEL = "stub-model"


@dataclass
class Stub:
    style: str = "vllm"
    cap: int | None = None
    fail_every: int = 0
    models: bool = True
    hold: int = 0
    hold_s: float = 5.0
    port: int = 0
    received: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def list_models(self, request: web.Request) -> web.Response:
        if not self.models:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"object": "list", "data": [{"id": STUB_MODEL}, {"id": "x"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(self.received)
        self.received.append((request.path, dict(request.headers), body))
        if self.fail_every and index % self.fail_every == self.fail_every - 1:
            return web.json_response({"error": "overloaded"}, status=503)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, body)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        count = body["max_tokens"] if self.cap is None else min(self.cap, body["max_tokens"])
        usage = {"prompt_tokens": 7, "completion_tokens": count, "total_tokens": 7 + count}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        deadline = time.monotonic() + self.hold_s
        while self.in_flight < self.hold and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        eol = "\r\n" if self.style == "hf" else "\n"

        async def send(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}{eol}{eol}".encode())
            await asyncio.sleep(0.002)

        def choice(text: str, **extra: Any) -> dict[str, Any]:
            part = {"delta": {"content": text}} if chat else {"text": text}
            return {"index": 0, **part, **extra}

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        if self.style == "vllm":
            await response.write(b": keep-alive\n\n")
            for _ in range(count):
                await send({"choices": [choice("t")]})
            await send({"choices": [], "usage": usage})
            await send("[DONE]")
        elif self.style == "hf":
            pairs = [min(2, count - at) for at in range(0, count, 2)]
            for number, size in enumerate(pairs, 1):
                extra = {"finish_reason": "length"} if number == len(pairs) else {}
                event: dict[str, Any] = {"choices": [choice("ab"[:size], **extra)]}
                if number == len(pairs):
                    event["usage"] = usage
                await send(event)
        elif self.style == "error":
            await send({"choices": [choice("t")]})
            await send({"error": {"message": "engine died", "code": 500}})
        else:  # broken
            await send({"choices": [choice("t")]})
            await send({"choices": [choice("t")]})
            assert request.transport is not None
            request.transport.close()
        return response


@contextlib.contextmanager
def serving(stub: Stub) -> Iterator[Stub]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> web.AppRunner:
        web_app = web.Application()
        web_app.router.add_get("/v1/models", stub.list_models)
        web_app.router.add_post("/v1/completions", stub.generate)
        web_app.router.add_post("/v1/chat/completions", stub.generate)
        runner = web.AppRunner(web_app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        stub.port = runner.addresses[0][1]
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield stub
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXPEDITOR_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def _workload(num: int = 6) -> Workload:
    load = skewed(num, seed=3, prompt_len=(4, 12), mean_output=6, max_output=9)
    requests = [*load.requests[:-1], _replace(load.requests[-1], ignore_eos=False)]
    return Workload(load.name, requests, load.description)


def _replace(req: BenchRequest, **changes: Any) -> BenchRequest:
    import msgspec

    return msgspec.structs.replace(req, **changes)


def _bench(target: str, model: Path, load: Workload, base: dict[str, Any] | None = None) -> Any:
    done: list[str] = []
    [(result, run)] = run_bench(
        load,
        [parse_target(target)],
        model=model,
        base_config=base or {},
        device="cpu",
        on_done=done.append,
    )
    assert len(done) == len(load.requests)  # progress advanced once per request
    return result, run


def _by_prompt(load: Workload) -> dict[tuple[int, ...], BenchRequest]:
    by_prompt = {tuple(r.prompt_token_ids): r for r in load.requests}
    assert len(by_prompt) == len(load.requests)
    return by_prompt


def _check_order(run: Any) -> None:
    for t in run.timelines:
        assert t.token_times_s == sorted(t.token_times_s)
        assert t.arrival_s < t.token_times_s[0] <= t.token_times_s[-1] <= t.finish_s


# -- driving a server ---------------------------------------------------------------------


def test_completions_with_done_and_usage_only_event(model: Path) -> None:
    load = _workload()
    with serving(Stub(style="vllm")) as stub:
        result, run = _bench(f"openai:{stub.url}", model, load)
    by_prompt = _by_prompt(load)
    assert len(stub.received) == len(load.requests)
    for path, headers, body in stub.received:
        req = by_prompt[tuple(body["prompt"])]
        assert path == "/v1/completions"
        assert body["model"] == STUB_MODEL  # the first id of GET /v1/models
        assert body["max_tokens"] == req.max_tokens and body["temperature"] == 0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body.get("ignore_eos") is (True if req.ignore_eos else None)
        assert "Authorization" not in headers
    assert sum(1 for *_, body in stub.received if "ignore_eos" in body) == len(load.requests) - 1
    asked = {r.request_id: r.max_tokens for r in load.requests}
    assert sorted(t.request_id for t in run.timelines) == sorted(asked)
    for t in run.timelines:
        assert t.num_output_tokens == len(t.token_times_s) == asked[t.request_id]
        assert t.num_prompt_tokens == 7  # usage.prompt_tokens
    _check_order(run)
    assert result.total_output_tokens == sum(asked.values())
    assert result.num_requests == len(load.requests)
    assert run.kv_samples is None and run.step_times is None and result.step_ms is None
    assert not any("failed" in note for note in result.notes)


def test_chat_without_done_usage_on_last_content_event(model: Path) -> None:
    load = _workload()
    with serving(Stub(style="hf", cap=5)) as stub:
        target = f"openai:{stub.url}[api=chat,api_key=s3cret,model=mine]"
        result, run = _bench(target, model, load)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    texts = {
        tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True): r for r in load.requests
    }
    assert len(texts) == len(load.requests)
    for path, headers, body in stub.received:
        assert path == "/v1/chat/completions"
        [message] = body["messages"]
        assert message["role"] == "user" and message["content"] in texts
        assert "<s>" not in message["content"]
        assert body["max_tokens"] == texts[message["content"]].max_tokens
        assert "ignore_eos" not in body and "prompt" not in body
        assert body["stream_options"] == {"include_usage": True} and body["stream"] is True
        assert body["model"] == "mine"
        assert headers["Authorization"] == "Bearer s3cret"
    asked = {r.request_id: r.max_tokens for r in load.requests}
    for t in run.timelines:
        assert t.num_output_tokens == len(t.token_times_s) == min(5, asked[t.request_id])
        # two tokens per event, one counted: the usage count spreads over the events, the
        # later ones taking the remainder (5 tokens in events of 2, 2, 1 -> 1, 2, 2)
        times, first = t.token_times_s, len(t.token_times_s) % 2
        assert all(times[i] == times[i + 1] for i in range(first, len(times) - 1, 2))
    _check_order(run)
    assert result.total_output_tokens == sum(min(5, n) for n in asked.values())
    assert "s3cret" not in result.target and "api_key=***" in result.target
    short = sum(1 for n in asked.values() if n > 5)
    assert short and f"{short} requests ended before max_tokens" in " ".join(result.notes)


def test_max_concurrency_bounds_requests_in_flight(model: Path) -> None:
    load = _workload(8)
    with serving(Stub(hold=8)) as stub:  # streams wait until all 8 are in flight
        _bench(f"openai:{stub.url}", model, load)
    assert stub.max_in_flight == 8  # unlimited: every request sent at once
    # style hf: the client sees a request end only with the body, after the stub counted
    # it out (with [DONE] it could send the next one before the stub's handler returned)
    with serving(Stub(style="hf", hold=2, hold_s=0.5)) as stub:
        result, _ = _bench(f"openai:{stub.url}[max_concurrency=2]", model, load)
    assert stub.max_in_flight == 2
    assert result.num_requests == 8


def test_a_request_waiting_for_a_slot_arrives_when_sent(model: Path) -> None:
    # as in vLLM's serving benchmark: with max_concurrency, arrival is when a request is
    # sent, so its TTFT leaves out the time it queued in the client
    with serving(Stub()) as stub:
        _, run = _bench(f"openai:{stub.url}[max_concurrency=1]", model, _workload(4))
    timelines = sorted(run.timelines, key=lambda t: t.arrival_s)
    assert all(a.finish_s <= b.arrival_s for a, b in itertools.pairwise(timelines))


def test_api_key_from_the_environment(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load = _workload(2)
    monkeypatch.setenv("OPENAI_API_KEY", "from-openai")
    with serving(Stub()) as stub:
        _bench(f"openai:{stub.url}", model, load)
    assert {h["Authorization"] for _, h, _ in stub.received} == {"Bearer from-openai"}
    monkeypatch.setenv("EXPEDITOR_API_KEY", "from-expeditor")  # wins over OPENAI_API_KEY
    with serving(Stub()) as stub:
        _bench(f"openai:{stub.url}/v1/", model, load)  # a /v1 base URL works too
    assert {h["Authorization"] for _, h, _ in stub.received} == {"Bearer from-expeditor"}


def test_model_name_falls_back_to_the_checkpoint(model: Path) -> None:
    with serving(Stub(models=False)) as stub:
        result, _ = _bench(f"openai:{stub.url}", model, _workload(2))
    assert {body["model"] for *_, body in stub.received} == {str(model)}
    assert any("HTTP 404" in note and "checkpoint" in note for note in result.notes)


def test_failed_requests_are_counted_in_a_note(model: Path) -> None:
    load = _workload(6)
    with serving(Stub(fail_every=3)) as stub:
        result, run = _bench(f"openai:{stub.url}", model, load)
    assert len(stub.received) == 6
    assert result.num_requests == len(run.timelines) == 4
    [note] = [n for n in result.notes if "failed" in n]
    assert note.startswith("2 of 6 requests failed: HTTP 503")
    assert "overloaded" in note  # the body of an example answer


@pytest.mark.parametrize(
    ("style", "message"),
    [
        ("broken", r"all 3 requests failed: broken stream \(ClientPayloadError\) x3"),
        ("error", r"all 3 requests failed: error event x3: .*engine died"),
    ],
)
def test_a_broken_stream_is_a_failure(model: Path, style: str, message: str) -> None:
    with (
        serving(Stub(style=style)) as stub,
        pytest.raises(TargetError, match=message),
    ):
        _bench(f"openai:{stub.url}", model, _workload(3))


def test_every_request_failing_fails_the_run(model: Path) -> None:
    with (
        serving(Stub(fail_every=1)) as stub,
        pytest.raises(TargetError, match=r"all 4 requests failed: HTTP 503 x4"),
    ):
        _bench(f"openai:{stub.url}", model, _workload(4))
    assert len(stub.received) == 4


def test_an_unreachable_server_fails_clearly(model: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(TargetError, match="cannot reach"):
        _bench(f"openai:http://127.0.0.1:{port}", model, _workload(2))


def test_scheduler_settings_are_noted_not_applied(model: Path) -> None:
    load = Workload("w", _workload(2).requests, "d", config={"num_gpu_blocks": 40})
    spec = parse_target("openai:http://127.0.0.1:1[api=chat]")
    assert target_config(load, {"max_num_seqs": 0}, spec) == {
        "url": "http://127.0.0.1:1",
        "api": "chat",
    }  # not validated as a scheduler config (max_num_seqs=0 would be refused)
    with serving(Stub()) as stub:
        result, _ = _bench(f"openai:{stub.url}", model, load, base={"max_num_seqs": 8})
    [note] = [n for n in result.notes if "not applied" in n]
    assert "num_gpu_blocks=40" in note and "max_num_seqs=8" in note


def test_cli_bench_json(model: Path) -> None:
    with serving(Stub(style="hf")) as stub:
        outcome = CliRunner().invoke(
            app,
            [
                "bench",
                *("--model", str(model), "--num-requests", "3", "--json"),
                *("--target", f"openai:{stub.url}[max_concurrency=2]"),
            ],
        )
    assert outcome.exit_code == 0, outcome.output
    report = json.loads(outcome.stdout.strip().splitlines()[-1])
    [result] = report["results"]
    assert result["target"] == f"openai:{stub.url}[max_concurrency=2]"
    assert result["num_requests"] == 3 and result["total_output_tokens"] > 0
    assert result["kv"] is None and result["step_ms"] is None


def test_cli_bench_passes_workload_args(model: Path) -> None:
    with serving(Stub(style="hf")) as stub:
        outcome = CliRunner().invoke(
            app,
            [
                "bench",
                *("--model", str(model), "--num-requests", "4", "--json"),
                *("--workload", "shared-prefix", "--workload-arg", "num_prefixes=2"),
                *("--workload-arg", "prefix-len=8", "--workload-arg", "suffix_len=[2,3]"),
                *("--target", f"openai:{stub.url}"),
            ],
        )
        assert outcome.exit_code == 0, outcome.output
        report = json.loads(outcome.stdout.strip().splitlines()[-1])
        assert (
            "one of 2 shared 8-token prefixes + a distinct 2-3-token suffix"
            in (report["description"])
        )
        refused = CliRunner().invoke(
            app,
            ["bench", "--model", str(model), "--workload-arg", "bogus=1"]
            + ["--target", f"openai:{stub.url}"],
        )
    assert refused.exit_code == 2
    assert "does not take bogus" in " ".join(refused.output.split())


def test_cli_bench_reports_total_failure(model: Path) -> None:
    with serving(Stub(fail_every=1)) as stub:
        outcome = CliRunner().invoke(
            app,
            ["bench", "--model", str(model), "--num-requests", "2"]
            + ["--target", f"openai:{stub.url}[api=chat]"],
        )
    assert outcome.exit_code == 2
    assert "all 2 requests failed: HTTP 503" in " ".join(outcome.output.split())


# -- parse_target ---------------------------------------------------------------------------


def test_parse_openai_targets() -> None:
    spec = parse_target("openai:http://127.0.0.1:8000")
    assert (spec.name, spec.label, spec.overrides) == ("openai", "openai:http://127.0.0.1:8000", {})
    assert spec.options == {"url": "http://127.0.0.1:8000"}
    text = "openai:http://h:1/v1[api=chat, model=m/x,max-concurrency=8]"
    spec = parse_target(text)
    assert spec.label == text
    assert spec.options == {
        "url": "http://h:1/v1",
        "api": "chat",
        "model": "m/x",
        "max_concurrency": 8,
    }
    spec = parse_target("openai:https://h[api_key=k1,api=completions]")
    assert spec.label == "openai:https://h[api_key=***,api=completions]"
    assert spec.options["api_key"] == "k1"
    assert parse_target("openai:http://[::1]:8000").options == {"url": "http://[::1]:8000"}
    spec = parse_target("openai:http://[::1][model=7]")
    assert spec.options == {"url": "http://[::1]", "model": "7"}  # a name stays text
    assert parse_target("openai:http://h[]").options == {"url": "http://h"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("openai", "give the server's address"),
        ("openai:", "not an http"),
        ("openai:127.0.0.1:8000", "not an http"),
        ("openai:ftp://h", "not an http"),
        ("openai:http://h[api=rest]", "api must be one of completions, chat"),
        ("openai:http://h[max_concurrency=0]", "max_concurrency must be an integer >= 1"),
        ("openai:http://h[max_concurrency=two]", "max_concurrency must be an integer >= 1"),
        ("openai:http://h[max_num_seqs=8]", "max_num_seqs is a scheduler setting"),
        ("openai:http://h[preemption_mode=swap]", "configure the server itself"),
        ("openai:http://h[temperature=1]", "not key=value with an option of api, model"),
        ("openai:http://h[api]", "not key=value"),
        ("openai:http://h[model=]", "option model needs a value"),
        ("openai:http://h[api=chat,api=chat]", "option api given twice"),
        ("opena:http://h", "unknown target"),
    ],
)
def test_parse_openai_target_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_target(text)


def test_other_targets_still_parse() -> None:
    spec = parse_target("expeditor[max_num_seqs=8]")
    assert (spec.name, spec.overrides, spec.options) == ("expeditor", {"max_num_seqs": 8}, {})
    with pytest.raises(ValueError, match="openai:URL"):
        parse_target("vllm")
    spec = parse_target("static[dtype=float32,max_num_seqs=4]")
    assert (spec.overrides, spec.options) == ({"max_num_seqs": 4}, {"dtype": "float32"})


# -- the pieces -----------------------------------------------------------------------------


def test_sse_decoder_across_chunk_boundaries() -> None:
    body = (
        b": comment\r\n\r\n"
        b'data: {"a": 1}\r\n\r\n'
        b'event: message\nid: 7\ndata:{"b": 2}\n\n'
        b"data: line1\ndata: line2\n\n"
        b"data: [DONE]\r\r"
        b"data: tail"
    )
    expected = ['{"a": 1}', '{"b": 2}', "line1\nline2", "[DONE]", "tail"]
    for size in (1, 2, 3, 7, len(body)):
        decoder = SSEDecoder()
        events = [e for at in range(0, len(body), size) for e in decoder.feed(body[at : at + size])]
        assert events + decoder.close() == expected, size
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []  # the \n may follow
    assert decoder.feed(b"\n\r\n") == ["x"]
    assert decoder.close() == []


def test_token_times_from_events_and_usage() -> None:
    def record(counts: list[int], usage: int | None) -> StreamRecord:
        rec = StreamRecord(times=[1.0, 2.0, 3.0][: len(counts)], counts=counts)
        rec.completion_tokens = usage
        return rec

    assert record([1, 1, 1], None).token_times(9.0) == [1.0, 2.0, 3.0]
    assert record([1, 2, 1], None).token_times(9.0) == [1.0, 2.0, 2.0, 3.0]
    # usage above the events' tokens: spread evenly, the later events taking the remainder
    assert record([1, 1, 1], 5).token_times(9.0) == [1.0, 2.0, 2.0, 3.0, 3.0]
    assert record([1, 1, 1], 4).token_times(9.0) == [1.0, 2.0, 3.0, 3.0]
    assert record([1, 1], 6).token_times(9.0) == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert record([1, 1, 1], 2).token_times(9.0) == [1.0, 2.0]  # usage below: earliest kept
    assert record([], 3).token_times(9.0) == [9.0, 9.0, 9.0]  # no content: at the finish
    assert record([], None).token_times(9.0) == []


def test_stream_record_counts_content_and_usage() -> None:
    rec = StreamRecord()
    rec.add({"choices": [{"delta": {"role": "assistant"}}]}, 1.0)  # no content: no token
    rec.add({"choices": [{"delta": {"content": ""}}]}, 1.5)
    rec.add({"choices": [{"delta": {"content": "hi"}}]}, 2.0)
    rec.add({"choices": [{"text": "x", "token_ids": [5, 6, 7]}]}, 3.0)  # ids count
    rec.add({"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 9}}, 4.0)
    assert (rec.times, rec.counts, rec.events) == ([2.0, 3.0], [1, 3], 5)
    assert (rec.completion_tokens, rec.prompt_tokens) == (4, 9)
    assert rec.token_times(5.0) == [2.0, 3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="error event"):
        rec.add({"error": {"message": "boom"}}, 6.0)
    with pytest.raises(ValueError, match="not a JSON object"):
        rec.add([1], 6.0)
