"""Start ``expeditor serve`` as a child process and wait for its address (for tests,
benchmarks and scripts); a free TCP port to give it."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(
    model: Path, *flags: str, timeout_s: float = 120.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yield (frontend address, the serve process); stop it with SIGTERM afterwards."""
    with running_serve(model, *flags, timeout_s=timeout_s) as (lines, proc):
        yield lines[0], proc


@contextmanager
def running_serve(
    model: Path, *flags: str, lines: int = 1, timeout_s: float = 120.0
) -> Iterator[tuple[list[str], subprocess.Popen[bytes]]]:
    """Yield (the first ``lines`` lines serve prints, the serve process): the frontend
    address, then with ``--http`` the gateway's URL (``lines=2``). Stopped with SIGTERM
    afterwards."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expeditor",
            "serve",
            *(["--model", str(model)] if model is not None else []),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    address = b""
    while address.count(b"\n") < lines:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            _, err = proc.communicate()
            raise RuntimeError(f"serve did not become ready: {err.decode()[-3000:]}")
        if selector.select(timeout=0.2):
            chunk = os.read(proc.stdout.fileno(), 4096)
            address += chunk
    try:
        yield address.decode().split("\n")[:lines], proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        selector.close()


def child_pids(parent: int) -> list[int]:
    """Direct children of ``parent`` (Linux /proc)."""
    children = Path(f"/proc/{parent}/task/{parent}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
