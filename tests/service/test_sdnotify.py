"""scheduler_svc.sdnotify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from support.blocking import in_thread
from support.limits import SAFETY_S

from scheduler_svc import sdnotify

T = TypeVar("T")

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs AF_UNIX sockets")


class Receiver:
    """The systemd end: a bound datagram socket that collects notifications."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def receive(self) -> str:
        return self.sock.recv(65536).decode()

    def drain(self) -> list[str]:
        """What is queued now, without waiting."""
        messages = []
        timeout = self.sock.gettimeout()
        self.sock.setblocking(False)
        try:
            while True:
                messages.append(self.receive())
        except BlockingIOError:
            return messages
        finally:
            self.sock.settimeout(timeout)


def _bound_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(SAFETY_S)  # a receive that never comes fails the test
    return sock


@pytest.fixture
def receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    path = tmp_path / "notify.sock"  # AF_UNIX paths are limited to ~107 bytes
    if len(os.fsencode(path)) > 100:
        pytest.skip(f"tmp_path too long for an AF_UNIX socket path: {path}")
    sock = _bound_socket(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    with sock:
        yield Receiver(sock)


@pytest.fixture(autouse=True)
def _no_systemd_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests must not talk to a real systemd if they happen to run under one."""
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------- notify


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (lambda: sdnotify.ready(), "READY=1"),
        (lambda: sdnotify.ready("serving 2 workers"), "READY=1\nSTATUS=serving 2 workers"),
        (lambda: sdnotify.watchdog(), "WATCHDOG=1"),
        (lambda: sdnotify.stopping(), "STOPPING=1"),
        (lambda: sdnotify.status("waiting for workers"), "STATUS=waiting for workers"),
    ],
    ids=["ready", "ready-status", "watchdog", "stopping", "status"],
)
def test_helpers_send_their_assignment(receiver: Receiver, send, expected: str) -> None:
    assert send() is True
    assert receiver.receive() == expected


def test_several_states_go_in_one_datagram(receiver: Receiver) -> None:
    assert sdnotify.notify("READY=1", "STATUS=up", "MAINPID=42") is True
    assert receiver.receive() == "READY=1\nSTATUS=up\nMAINPID=42"
    assert receiver.drain() == []


def test_status_text_is_kept_on_one_line(receiver: Receiver) -> None:
    assert sdnotify.status("line one\nline two") is True
    assert receiver.receive() == "STATUS=line one line two"


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"expeditor-test-{uuid.uuid4().hex}"
    try:
        sock = _bound_socket("\0" + name)
    except OSError as error:  # pragma: no cover - non-Linux
        pytest.skip(f"no abstract AF_UNIX namespace here: {error}")
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    with sock:
        assert sdnotify.ready() is True
        assert sock.recv(65536) == b"READY=1"


def test_unset_notify_socket_is_a_no_op() -> None:
    assert "NOTIFY_SOCKET" not in os.environ
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready("x") is False
    assert sdnotify.watchdog() is False


def test_empty_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sdnotify.notify("READY=1") is False


def test_nothing_to_send(receiver: Receiver) -> None:
    assert sdnotify.notify() is False
    assert receiver.drain() == []


@pytest.mark.parametrize(
    "address",
    [
        "{tmp}/missing.sock",  # nothing bound there
        "{tmp}/no-such-dir/notify.sock",
        "@expeditor-test-nobody-listens-{uid}",
        "vsock:2:1234",  # a form this implementation does not speak
    ],
)
def test_unreachable_socket_returns_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", address.format(tmp=tmp_path, uid=uuid.uuid4().hex))
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.watchdog() is False


def test_socket_that_is_not_a_datagram_socket_returns_false(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "stream.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
        stream.bind(str(path))
        stream.listen()
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sdnotify.notify("READY=1") is False


def _fill_queue(address: str) -> None:
    """Send datagrams to ``address`` until its receive queue is full."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for _ in range(100_000):
            try:
                sender.sendto(b"X=1", address)
            except BlockingIOError:
                return
    pytest.fail("the receive queue never filled up")


def test_full_queue_neither_blocks_for_good_nor_raises(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With systemd's receive queue full, notify() gives up after SEND_TIMEOUT_S and
    returns False; the watchdog task drops its pings (sent without blocking) and keeps
    running. Nobody drains the queue here, so a send that blocked would block for good:
    the calls run in a thread that the test only waits on for SAFETY_S."""
    monkeypatch.setattr(sdnotify, "SEND_TIMEOUT_S", 0.05)
    _fill_queue(os.environ["NOTIFY_SOCKET"])
    assert in_thread(lambda: sdnotify.notify("READY=1")) is False

    checks = 0

    async def main() -> None:
        enough = asyncio.Event()

        def healthy() -> bool:  # called before each ping: one more ping was attempted
            nonlocal checks
            checks += 1
            if checks == 5:
                enough.set()
            return True

        task = asyncio.create_task(sdnotify.Watchdog(0.01, healthy=healthy).run())
        await enough.wait()  # four pings went out (or were dropped) and the task runs on
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    in_thread(lambda: asyncio.run(main()))
    assert checks >= 5
    queued = receiver.drain()
    assert queued and set(queued) == {"X=1"}  # the pings were dropped, not queued


# --------------------------------------------------------------------------- watchdog_interval


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),  # no watchdog configured
        ("30000000", None, 15.0),  # WatchdogSec=30: ping every 15 s
        ("30000000", "self", 15.0),
        ("30000000", "other", None),  # the watchdog is some other process's
        ("1000", None, 0.0005),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        ("30000000", "not-a-pid", None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    if usec is not None:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid == "self":
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    elif pid == "other":
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    elif pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", pid)
    assert sdnotify.watchdog_interval() == (None if expected is None else pytest.approx(expected))


# --------------------------------------------------------------------------- Watchdog


async def _pings_while_running(dog: sdnotify.Watchdog, receiver: Receiver, count: int) -> list[str]:
    """Run ``dog`` until ``receiver`` got ``count`` notifications, then cancel it; the
    notifications, each received while the task was still running."""
    task = asyncio.create_task(dog.run())
    received = []
    for _ in range(count):
        received.append(await asyncio.to_thread(receiver.receive))  # SAFETY_S at most
        assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    return received


def test_watchdog_pings_repeatedly_until_cancelled(receiver: Receiver) -> None:
    pings = asyncio.run(_pings_while_running(sdnotify.Watchdog(0.01), receiver, 3))
    assert pings == ["WATCHDOG=1"] * 3
    # What the task sent before it was cancelled is all there is: nothing but pings.
    assert set(receiver.drain()) <= {"WATCHDOG=1"}


def test_watchdog_takes_its_interval_from_the_environment(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # ping every 10 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    dog = sdnotify.Watchdog()
    assert dog.interval == pytest.approx(0.01)
    assert asyncio.run(_pings_while_running(dog, receiver, 3)) == ["WATCHDOG=1"] * 3


def test_watchdog_without_interval_returns_at_once(receiver: Receiver) -> None:
    dog = sdnotify.Watchdog()
    assert dog.interval is None
    run = dog.run()
    with pytest.raises(StopIteration):  # finished on its first step: it never waited
        run.send(None)
    assert receiver.drain() == []


def test_watchdog_withholds_pings_while_unhealthy(receiver: Receiver) -> None:
    """Each check that says unhealthy withholds that ping; pings resume once healthy."""
    healthy = True
    checks = {True: 0, False: 0}
    checked = asyncio.Event()

    def check() -> bool:
        checks[healthy] += 1
        checked.set()
        return healthy

    async def checks_while(state: bool, count: int) -> None:
        while checks[state] < count:
            checked.clear()
            await checked.wait()

    async def main() -> None:
        nonlocal healthy
        task = asyncio.create_task(sdnotify.Watchdog(0.01, healthy=check).run())
        await checks_while(True, 2)
        # The task sleeps between checks on this loop, so every ping it sent is queued.
        assert receiver.drain() == ["WATCHDOG=1"] * checks[True]
        healthy = False
        await checks_while(False, 3)
        assert receiver.drain() == []  # three checks said unhealthy: no ping
        healthy = True
        await checks_while(True, checks[True] + 1)
        assert receiver.drain() == ["WATCHDOG=1"]  # healthy again: pinging again
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), SAFETY_S))


@pytest.mark.parametrize("interval", [0.0, -1.0])
def test_watchdog_rejects_a_non_positive_interval(interval: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        sdnotify.Watchdog(interval)
