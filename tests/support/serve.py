"""Real ``expeditor serve`` processes for end-to-end tests: one with its HTTP gateway
on a free port, the processes it runs (found by role through /proc), what they hold,
and a batch of greedy requests through the client library.

Starting serve itself and waiting for its address is
:func:`scheduler_svc.launch.running_serve`'s; this adds what several test modules
need around it."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ipc.client import AsyncClient
from scheduler_svc.launch import child_pids, cmdline, free_port, running_serve


@contextmanager
def running_http_serve(
    model: Path, *flags: str, timeout_s: float = 120.0
) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """``expeditor serve --http`` on a free loopback port: (frontend address, gateway
    URL, the serve process); stopped with SIGTERM afterwards."""
    http = ("--http", f"127.0.0.1:{free_port()}")
    with running_serve(model, *http, *flags, lines=2, timeout_s=timeout_s) as (lines, proc):
        yield lines[0], lines[1], proc


def children_in_role(serve_pid: int, role: str) -> list[int]:
    """The direct children of ``serve_pid`` started as ``expeditor ROLE`` (``worker``,
    ``scheduler``, ``gateway``)."""
    return [pid for pid in child_pids(serve_pid) if f" {role} " in cmdline(pid)]


def descendants_named(pid: int, word: bytes) -> list[int]:
    """Every descendant of ``pid`` (at any depth) whose command line holds ``word``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    todo, found = [pid], []
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                command = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if word in command:
                found.append(child)
    return found


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def generate_all(
    address: str, prompts: list[list[int]], max_tokens: int, timeout: float
) -> list[list[int]]:
    """The greedy output tokens of every prompt, all sent at once to ``address``."""
    async with AsyncClient(address, timeout=timeout) as client:
        done = await asyncio.gather(
            *(
                client.generate(prompt_token_ids=p, max_tokens=max_tokens, temperature=0.0)
                for p in prompts
            )
        )
    return [c.token_ids for c in done]
