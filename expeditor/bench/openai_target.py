"""``openai:URL``: any OpenAI-compatible HTTP server, driven over streaming HTTP.

The target sends the workload's requests to a server that is already running
(``expeditor serve --http``, vLLM, SGLang, ``transformers serve``, ...) with
``stream: true`` and ``stream_options: {include_usage: true}``, and timestamps every
server-sent event as it arrives, so TTFT and ITL are what an HTTP client sees.

Target syntax: ``openai:URL`` or ``openai:URL[key=value,...]`` with the options

- ``api``: ``completions`` (default; ``POST /v1/completions`` with the prompt as a list of
  token ids and ``ignore_eos`` when the workload request asks for it) or ``chat``
  (``POST /v1/chat/completions`` with one user message: the prompt's token ids decoded to
  text by the checkpoint's ``tokenizer.json``; no ``ignore_eos``, which some servers
  refuse, so outputs may end early at EOS, and the server applies its chat template, so
  prompt lengths differ from the workload's);
- ``model``: the model name sent (default: the first id ``GET /v1/models`` lists, else the
  checkpoint directory);
- ``api_key``: sent as ``Authorization: Bearer``; default ``$EXPEDITOR_API_KEY``, else
  ``$OPENAI_API_KEY``; it is masked in the target's label;
- ``max_concurrency``: at most this many requests in flight (default: no limit, each
  request is sent at its workload arrival time).

Each request is sent at its arrival time (after waiting for a free slot under
``max_concurrency``); its ``arrival_s`` is when it is sent, as in vLLM's serving
benchmark. Counting tokens: an event whose choice carries ``token_ids`` counts that many
tokens, else one whose text (``text``, ``delta.content`` or ``message.content``) is
non-empty counts one token, all at the event's arrival time. When the server reports
``usage.completion_tokens`` that number is the request's output token count: if it is
larger than the tokens seen (a server that sends several tokens per event, or holds text
back until it decodes to whole characters), the extra tokens are spread evenly over the
content events, later events taking the remainder (as the ``expeditor`` target repeats
one time for a multi-token delta); if it is smaller, the earliest times are kept. With
usage but no content event the tokens all count at the finish. ``usage.prompt_tokens``
likewise replaces the workload's prompt length. ``data: [DONE]`` ends a stream but is
optional: the end of the body ends it too.

A request answered with an HTTP status other than 200, an error event, a broken or empty
stream counts as failed: it gets no timeline, and the run carries a note; if every
request fails the run raises :class:`~expeditor.bench.targets.TargetError`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from expeditor.bench.metrics import RequestTimeline
from expeditor.bench.targets import OnDone, TargetError, TargetRun
from expeditor.bench.workloads import BenchRequest, Workload

if TYPE_CHECKING:
    import aiohttp

PREFIX = "openai:"
APIS = ("completions", "chat")
OPTIONS = ("api", "model", "api_key", "max_concurrency")
API_KEY_ENV = ("EXPEDITOR_API_KEY", "OPENAI_API_KEY")
READ_TIMEOUT_S = 600.0
"""A stream silent for this long is broken."""
_json_decode = msgspec.json.decode

__all__ = [
    "APIS",
    "OPTIONS",
    "PREFIX",
    "SSEDecoder",
    "StreamRecord",
    "parse_openai_target",
    "run_openai",
]


# -- the target text ------------------------------------------------------------------------


def _split_options(rest: str) -> tuple[str, str | None]:
    """``URL[opts]`` -> (URL, opts); ``None`` when there is no option bracket. A trailing
    ``[...]`` right after ``//`` or ``@`` is the URL's IPv6 host (``http://[::1]``)."""
    open_at = rest.rfind("[")
    if not rest.endswith("]") or open_at < 1 or rest[open_at - 1] in "/@":
        return rest, None
    return rest[:open_at], rest[open_at + 1 : -1]


def parse_openai_target(text: str) -> tuple[dict[str, Any], str]:
    """``openai:URL[key=value,...]`` -> (options with ``url``, label).

    The label is the text with an ``api_key`` value masked. Raises ValueError for a
    missing or malformed URL, an unknown option (a scheduler setting among them: the
    server's own configuration holds) or a bad value.
    """
    from shared.config import SCHEDULER_FIELDS

    if not text.startswith(PREFIX):
        raise ValueError(f"target {text!r}: expected {PREFIX}URL[key=value,...]")
    url, inner = _split_options(text[len(PREFIX) :])
    url = url.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as exc:
        raise ValueError(f"target {text!r}: bad URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"target {text!r}: {url!r} is not an http(s) URL (e.g. openai:http://127.0.0.1:8000)"
        )
    options: dict[str, Any] = {"url": url}
    shown: list[str] = []
    for item in filter(None, (inner or "").split(",")):
        key, sep, value = item.partition("=")
        key, value = key.strip().replace("-", "_"), value.strip()
        if key in SCHEDULER_FIELDS:
            raise ValueError(
                f"target {text!r}: {key} is a scheduler setting; an openai target drives a "
                "server that is already running, so configure the server itself "
                f"(options here: {', '.join(OPTIONS)})"
            )
        if not sep or key not in OPTIONS:
            raise ValueError(
                f"target {text!r}: {item.strip()!r} is not key=value with an option of "
                f"{', '.join(OPTIONS)}"
            )
        if key in options:
            raise ValueError(f"target {text!r}: option {key} given twice")
        if key == "api" and value not in APIS:
            raise ValueError(f"target {text!r}: api must be one of {', '.join(APIS)}")
        if key == "max_concurrency":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"target {text!r}: max_concurrency must be an integer >= 1")
            options[key] = int(value)
        elif not value:
            raise ValueError(f"target {text!r}: option {key} needs a value")
        else:
            options[key] = value
        shown.append(f"{key}=***" if key == "api_key" else item.strip())
    if "api_key" not in options:
        return options, text
    return options, f"{PREFIX}{url}[{','.join(shown)}]"


# -- server-sent events ---------------------------------------------------------------------


class SSEDecoder:
    """Incremental decoder of a ``text/event-stream`` body into the events' data strings.

    Lines end with ``\\n``, ``\\r\\n`` or ``\\r``; an event is the ``data:`` lines up to a
    blank line, joined by ``\\n``; comment lines (``:``) and other fields are ignored.
    :meth:`close` returns an event the body ended without a blank line after.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        buffer, tail = self._buffer + chunk, b""
        if b"\r" in buffer:
            if buffer.endswith(b"\r"):  # may be the first half of a \r\n
                buffer, tail = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = buffer.split(b"\n")
        self._buffer = rest + tail
        events: list[str] = []
        for line in lines:
            if event := self._line(line.decode("utf-8", errors="replace")):
                events.append(event)
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def close(self) -> list[str]:
        tail = self._buffer.decode("utf-8", errors="replace").rstrip("\r")
        self._buffer = b""
        events = [event] if tail and (event := self._line(tail)) else []
        if event := self._line(""):
            events.append(event)
        return events


# -- one request's stream -------------------------------------------------------------------


@dataclass
class StreamRecord:
    """What one streamed answer delivered: the arrival times of its content events, the
    tokens each carried, and the server's usage figures (``None``: not reported)."""

    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    events: int = 0
    done: bool = False

    def add(self, payload: Any, now: float) -> None:
        """Account for one decoded JSON event (or a whole non-streamed answer)."""
        if not isinstance(payload, dict):
            raise ValueError(f"event is not a JSON object: {str(payload)[:120]}")
        self.events += 1
        if payload.get("error") is not None:
            raise ValueError(f"error event: {json.dumps(payload['error'])[:200]}")
        for choice in payload.get("choices") or []:
            if isinstance(choice, dict) and (count := _tokens_in(choice)):
                self.times.append(now)
                self.counts.append(count)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]

    def token_times(self, finish: float) -> list[float]:
        """One time per output token (see the module docstring for the usage rules)."""
        seen = sum(self.counts)
        total = seen if self.completion_tokens is None else self.completion_tokens
        if not self.times:
            return [finish] * total
        counts = list(self.counts)
        extra, k = total - seen, len(counts)
        if extra > 0:
            counts = [c + extra * (i + 1) // k - extra * i // k for i, c in enumerate(counts)]
        times = [t for t, c in zip(self.times, counts, strict=True) for _ in range(c)]
        return times[:total]


def _tokens_in(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        return len(ids)
    texts = [choice.get("text")]
    for key in ("delta", "message"):
        if isinstance(part := choice.get(key), dict):
            texts.append(part.get("content"))
    return 1 if any(isinstance(t, str) and t for t in texts) else 0


# -- the run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Setup:
    base: str
    api: str
    model: str


def _base_url(url: str) -> str:
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _api_key(options: dict[str, Any]) -> str | None:
    if options.get("api_key"):
        return str(options["api_key"])
    return next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)


def run_openai(
    workload: Workload, model: Path, config: dict[str, Any], device: str, on_done: OnDone
) -> TargetRun:
    """Drive the server at ``config["url"]`` (options from :func:`parse_openai_target`).
    ``device`` does not apply: the server runs where it runs."""
    del device
    return asyncio.run(_drive(workload, model, config, on_done))


async def _detect_model(session: aiohttp.ClientSession, base: str) -> tuple[str | None, str]:
    """The first model id ``GET /v1/models`` lists, or ``None`` with the reason."""
    import aiohttp

    try:
        async with session.get(f"{base}/v1/models") as response:
            if response.status != 200:
                return None, f"GET /v1/models answered HTTP {response.status}"
            body = await response.json(content_type=None)
    except (aiohttp.ClientResponseError, ValueError) as exc:
        return None, f"GET /v1/models gave no model list ({exc})"
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TargetError(
            f"openai target: cannot reach {base}: {exc or type(exc).__name__}"
        ) from None
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"]), ""
    return None, "GET /v1/models listed no model"


def _body(setup: _Setup, req: BenchRequest, prompt_text: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": setup.model}
    if setup.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt_text}]
    else:
        body["prompt"] = list(req.prompt_token_ids)
    body.update(
        max_tokens=req.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if setup.api == "completions" and req.ignore_eos:
        body["ignore_eos"] = True
    if req.structured_outputs is not None:  # vLLM's form (expeditor's gateway takes it)
        body["structured_outputs"] = req.structured_outputs
    return body


async def _request(
    session: aiohttp.ClientSession, setup: _Setup, req: BenchRequest, prompt_text: str | None
) -> RequestTimeline:
    """Send one request and read its stream; raises on any failure."""
    path = "/v1/chat/completions" if setup.api == "chat" else "/v1/completions"
    arrival = time.perf_counter()
    record = StreamRecord()
    async with session.post(setup.base + path, json=_body(setup, req, prompt_text)) as response:
        if response.status != 200:
            text = (await response.text(errors="replace")).strip().replace("\n", " ")
            raise _Failed(f"HTTP {response.status}", text[:200])
        if response.content_type == "application/json":  # the server did not stream
            try:
                record.add(await response.json(content_type=None), time.perf_counter())
            except ValueError as exc:
                raise _Failed("bad answer", str(exc)[:200]) from None
        else:
            decoder = SSEDecoder()
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                if _take(record, decoder.feed(chunk), now):
                    break
            else:
                _take(record, decoder.close(), time.perf_counter())
    finish = time.perf_counter()
    if not record.events:
        raise _Failed("empty stream", "no JSON event" + (" before [DONE]" if record.done else ""))
    times = record.token_times(finish)
    return RequestTimeline(
        request_id=req.request_id,
        arrival_s=arrival,
        token_times_s=times,
        finish_s=finish,
        num_prompt_tokens=record.prompt_tokens or len(req.prompt_token_ids),
        num_output_tokens=len(times),
    )


def _take(record: StreamRecord, events: list[str], now: float) -> bool:
    """Account for decoded events; True once ``[DONE]`` came."""
    for data in events:
        if data.strip() == "[DONE]":
            record.done = True
            return True
        try:
            payload = _json_decode(data)
        except msgspec.DecodeError:
            raise _Failed("bad event", f"not JSON: {data[:120]!r}") from None
        try:
            record.add(payload, now)
        except ValueError as exc:
            kind = (
                "error event" if isinstance(payload, dict) and "error" in payload else "bad event"
            )
            raise _Failed(kind, str(exc)) from None
    return False


class _Failed(Exception):
    """One request failed: ``kind`` groups failures in the note, ``detail`` is an example."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def _tokenizer(model: Path) -> Any:
    from shared.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model)
    except Exception as exc:  # the tokenizers library raises its own Exception type
        raise TargetError(f"openai target, api=chat: cannot load {model}: {exc}") from None


async def _drive(
    workload: Workload, model: Path, options: dict[str, Any], on_done: OnDone
) -> TargetRun:
    import aiohttp

    api = str(options.get("api", "completions"))
    texts: dict[str, str] = {}
    if api == "chat":
        tokenizer = _tokenizer(model)
        texts = {
            r.request_id: tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True)
            for r in workload.requests
        }
    limit = options.get("max_concurrency")
    key = _api_key(options)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = _base_url(str(options["url"]))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=READ_TIMEOUT_S)
    notes: list[str] = []
    timelines: list[RequestTimeline] = []
    failures: Counter[str] = Counter()
    examples: dict[str, str] = {}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit or 0),
        timeout=timeout,
        headers=headers,
    ) as session:
        name = options.get("model")
        if not name:
            name, why = await _detect_model(session, base)
            if name is None:
                name = str(model)
                notes.append(f"{why}: model name sent is the checkpoint directory")
        setup = _Setup(base, api, str(name))
        slots = asyncio.Semaphore(limit) if limit else None
        start = time.perf_counter()

        async def one(req: BenchRequest) -> None:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            try:
                if slots is None:
                    timelines.append(await _request(session, setup, req, texts.get(req.request_id)))
                else:
                    async with slots:
                        timeline = await _request(session, setup, req, texts.get(req.request_id))
                    timelines.append(timeline)
            except _Failed as exc:
                failures[exc.kind] += 1
                examples.setdefault(exc.kind, exc.detail)
            except (aiohttp.ClientError, TimeoutError) as exc:
                kind = f"broken stream ({type(exc).__name__})"
                failures[kind] += 1
                examples.setdefault(kind, str(exc) or type(exc).__name__)
            finally:
                on_done()

        await asyncio.gather(*(one(r) for r in workload.requests))
    failed = sum(failures.values())
    if failed:
        summary = "; ".join(
            f"{kind} x{count}: {examples[kind]}" if examples[kind] else f"{kind} x{count}"
            for kind, count in failures.most_common()
        )
        if failed == len(workload.requests):
            raise TargetError(
                f"openai target {base}: all {failed} requests failed: {summary}"[:1000]
            )
        notes.append(f"{failed} of {len(workload.requests)} requests failed: {summary}"[:500])
    notes.append(f"{api} API at {base}, model {setup.model!r}")
    if api == "chat":
        notes.append(
            "chat: prompts decoded to text and re-tokenized by the server with its chat "
            "template; no ignore_eos, so outputs may end early at EOS"
        )
    asked = {r.request_id: r.max_tokens for r in workload.requests}
    short = sum(1 for t in timelines if t.num_output_tokens < asked[t.request_id])
    if short:
        notes.append(f"{short} requests ended before max_tokens (EOS or a server limit)")
    return TargetRun(timelines=timelines, notes=notes)
