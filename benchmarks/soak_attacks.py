"""The hostile HTTP inputs of the soak (benchmarks/soak_http.py): each attack is one
coroutine that sends its kind of request again and again until the run stops, and
records what the gateway answered. An attack "holds" when every answer is the refusal
it expects (or, for the connection attacks, the server closes the connection in time)
and the normal traffic meanwhile keeps being served."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

REFUSALS = {400, 413, 422, 429, 431}
"""The statuses a refused attack may get (a size limit, a validation error, a cap)."""
SLOW_CONNECTIONS = 200
"""Connections the slowloris attack keeps open, never finishing their headers."""


@dataclass(slots=True)
class AttackLog:
    """What each attack got back: status (or event) -> count, and unexpected answers."""

    answers: dict[str, Counter[str]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, attack: str, answer: str, seconds: float, *, expected: bool) -> None:
        self.answers.setdefault(attack, Counter())[answer] += 1
        self.seconds.setdefault(attack, []).append(seconds)
        if not expected and len(self.unexpected) < 20:
            self.unexpected.append(f"{attack}: {answer}")

    def report(self) -> dict[str, object]:
        return {
            "answers": {k: dict(v) for k, v in sorted(self.answers.items())},
            "max_answer_s": {k: round(max(v), 2) for k, v in sorted(self.seconds.items())},
            "unexpected": self.unexpected,
        }


def _outage() -> dict[str, object]:
    return {
        "prompt": [1, 17, 42],
        "n": 64,
        "max_tokens": 8,
        "min_tokens": 4,
        "stop_token_ids": list(range(200_000)),
    }


def _batch() -> dict[str, object]:
    return {"prompt": [[65]] * 100_000, "max_tokens": 1}


def _echo() -> dict[str, object]:
    return {"prompt": [[65] * 500] * 1900, "echo": True, "max_tokens": 0, "n": 64}


def _template_override() -> dict[str, object]:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(1000)
    ]
    return {
        "messages": messages,
        "max_tokens": 4,
        "chat_template_kwargs": {"bos_token": "B" * 1000},
    }


def _deep_json() -> bytes:
    return b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b', "max_tokens": 2}'


def _huge_int() -> bytes:
    return b'{"prompt": [1, 2], "max_tokens": ' + str(2**70).encode() + b"}"


class Attacks:
    """Every attack against the gateway at ``host:port``, until ``stop`` is set."""

    def __init__(self, host: str, port: int, stop: asyncio.Event) -> None:
        self.host, self.port, self.stop = host, port, stop
        self.log = AttackLog()
        self.url = f"http://{host}:{port}"

    def tasks(self) -> list[Awaitable[None]]:
        json_attacks: list[tuple[str, str, Callable[[], object], float]] = [
            ("outage_stop_ids", "/v1/completions", _outage, 10.0),
            ("batch_100k", "/v1/completions", _batch, 20.0),
            ("echo_amplification", "/v1/completions", _echo, 15.0),
            ("template_override", "/v1/chat/completions", _template_override, 15.0),
            ("deep_json", "/v1/completions", _deep_json, 5.0),
            ("huge_int", "/v1/completions", _huge_int, 5.0),
        ]
        return [
            *(self._repeat(name, path, make, period) for name, path, make, period in json_attacks),
            self._slowloris(),
            self._huge_header(),
            self._never_read(),
            self._metrics_storm(),
        ]

    async def _sleep(self, seconds: float) -> bool:
        """Wait, or return False at once when the run is over."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            return True
        return False

    async def _repeat(
        self, name: str, path: str, make: Callable[[], object], period: float
    ) -> None:
        body = make()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        timeout = aiohttp.ClientTimeout(total=120)
        # A connection per request: a kept-alive one may meet the server's keep-alive
        # timeout on its way, which says nothing about how the attack was answered.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while await self._sleep(period):
                started = time.monotonic()
                try:
                    headers = {"content-type": "application/json"}
                    async with session.post(self.url + path, data=data, headers=headers) as r:
                        await r.read()
                        answer = str(r.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    answer = type(exc).__name__
                elapsed = time.monotonic() - started
                self.log.add(name, answer, elapsed, expected=answer in map(str, REFUSALS))

    async def _slowloris(self) -> None:
        """Connections that never finish their headers: each must be closed by the
        server (its header timeout); a closed one is replaced, so SLOW_CONNECTIONS
        stay open all the time."""

        async def one() -> None:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                except OSError as exc:
                    self.log.add("slowloris", f"connect {type(exc).__name__}", 0.0, expected=True)
                    await self._sleep(1.0)
                    continue
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                try:
                    while not self.stop.is_set():
                        writer.write(b"a")
                        await writer.drain()
                        try:
                            if await asyncio.wait_for(reader.read(1024), 5.0) == b"":
                                break  # closed by the server
                        except TimeoutError:
                            continue  # still open: another byte
                except OSError:
                    pass  # reset by the server
                finally:
                    writer.close()
                if not self.stop.is_set():
                    elapsed = time.monotonic() - started
                    self.log.add("slowloris", "closed by server", elapsed, expected=True)

        await asyncio.gather(*(one() for _ in range(SLOW_CONNECTIONS)))

    async def _huge_header(self) -> None:
        """A 10 MB header line: refused (431/400) or cut as it arrives."""
        line = b"X-Big: " + b"a" * 10_000_000 + b"\r\n"
        while await self._sleep(20.0):
            started = time.monotonic()
            answer = "sent whole"
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                for offset in range(0, len(line), 65536):
                    writer.write(line[offset : offset + 65536])
                    await writer.drain()
                writer.write(b"\r\n")
                status = await asyncio.wait_for(reader.readline(), 30.0)
                answer = status.decode(errors="replace").split(" ")[1] if status else "closed"
                writer.close()
            except (OSError, TimeoutError, IndexError) as exc:
                answer = f"cut ({type(exc).__name__})"
            elapsed = time.monotonic() - started
            self.log.add("huge_header", answer, elapsed, expected=answer != "200")

    async def _never_read(self) -> None:
        """A big stream (64 x 1,000 tokens with logprobs) whose reader takes nothing for
        45 s: the gateway must neither buffer it all nor keep the connection (its
        send_timeout_s closes it, or max_stream_buffer_bytes aborts the request)."""
        body = json.dumps(
            {
                "prompt": [1, 2, 3],
                "n": 64,
                "max_tokens": 1000,
                "logprobs": 5,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        while await self._sleep(15.0):
            started = time.monotonic()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
                reader, writer = await asyncio.open_connection(sock=sock)
                writer.write(head + body)
                await writer.drain()
                await self._sleep(45.0)  # never read
                data = await asyncio.wait_for(reader.read(-1), 60.0)
                if b"max_stream_buffer_bytes" in data:
                    answer = "aborted at the buffer limit"
                elif data.rstrip().endswith(b"data: [DONE]"):
                    answer = "whole stream kept"
                else:
                    answer = "closed by server"
                writer.close()
            except (ConnectionResetError, BrokenPipeError):
                answer = "reset by server"
            except (OSError, TimeoutError) as exc:
                answer = type(exc).__name__
            elapsed = time.monotonic() - started
            self.log.add("never_read", answer, elapsed, expected=answer != "whole stream kept")

    async def _metrics_storm(self) -> None:
        """About 100 scrapes a second."""
        async with aiohttp.ClientSession() as session:
            while await self._sleep(0.01):
                started = time.monotonic()
                try:
                    async with session.get(self.url + "/metrics/") as r:
                        await r.read()
                        answer = str(r.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    answer = type(exc).__name__
                self.log.add(
                    "metrics_storm", answer, time.monotonic() - started, expected=answer == "200"
                )
