"""The systemd ``sd_notify`` protocol, in pure Python (no libsystemd).

A service started by systemd with ``Type=notify`` (or with ``WatchdogSec=``) reports
its state by sending newline-separated ``KEY=VALUE`` assignments, in one datagram, to
the ``AF_UNIX`` ``SOCK_DGRAM`` socket named by ``$NOTIFY_SOCKET``; see
sd_notify(3) and systemd.service(5). The variables used here:

``READY=1``
    Start-up is finished; ``systemctl start`` returns and ordered units start.
``STOPPING=1``
    The service is beginning its shutdown.
``STATUS=...``
    A one-line free-form status shown by ``systemctl status``.
``WATCHDOG=1``
    Keep-alive ping. With ``WatchdogSec=`` set, systemd passes ``$WATCHDOG_USEC``
    (the timeout in microseconds) and ``$WATCHDOG_PID`` (the process the watchdog
    applies to) and kills and, with ``Restart=``, restarts a service that stays
    silent for longer than the timeout. sd_watchdog_enabled(3) advises pinging at
    half the timeout.

Environment read: ``$NOTIFY_SOCKET`` (a filesystem path, or ``@name`` for the Linux
abstract namespace, where the ``@`` stands for a leading NUL byte), ``$WATCHDOG_USEC``
and ``$WATCHDOG_PID``. Outside systemd ``$NOTIFY_SOCKET`` is unset and every call is a
cheap no-op returning ``False``; a failed send is logged at debug level and never
raised, because a lost notification must not take the daemon down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

__all__ = [
    "Watchdog",
    "notify",
    "ready",
    "status",
    "stopping",
    "watchdog",
    "watchdog_interval",
]

log = logging.getLogger(__name__)


def _socket_address(raw: str) -> str | None:
    """The ``sendto`` address for ``$NOTIFY_SOCKET``, or ``None`` if not AF_UNIX."""
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # e.g. systemd >= 254's "vsock:..." addresses, not supported here


SEND_TIMEOUT_S = 1.0
"""Longest a notification may block when systemd's receive queue is full (it drains
it promptly, so in practice a send never waits)."""


def notify(*states: str) -> bool:
    """Send ``states`` (``"KEY=VALUE"`` strings) to systemd as one datagram.

    Returns ``True`` once the datagram is sent; ``False`` when ``$NOTIFY_SOCKET`` is
    unset (not run by systemd), when there is nothing to send, or when sending failed
    or would have blocked longer than :data:`SEND_TIMEOUT_S`. Never raises.
    """
    return _send(states, timeout=SEND_TIMEOUT_S)


def _send(states: tuple[str, ...], *, timeout: float) -> bool:
    """:func:`notify` with a send timeout in seconds (``0`` = never block)."""
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw or not states:
        return False
    address = _socket_address(raw)
    if address is None:
        log.debug("sd_notify: unsupported NOTIFY_SOCKET address %r", raw)
        return False
    payload = "\n".join(states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(timeout)
            sock.sendto(payload, address)
    except OSError as error:  # includes timeouts and, with timeout=0, BlockingIOError
        log.debug("sd_notify: cannot send %r to %r: %s", payload, raw, error)
        return False
    return True


def _one_line(text: str) -> str:
    """``text`` with line breaks turned into spaces: a newline would end the assignment."""
    return " ".join(text.splitlines())


def ready(status: str | None = None) -> bool:
    """Tell systemd start-up is complete (``READY=1``), with an optional ``STATUS=``."""
    if status is None:
        return notify("READY=1")
    return notify("READY=1", f"STATUS={_one_line(status)}")


def stopping() -> bool:
    """Tell systemd the service is shutting down (``STOPPING=1``)."""
    return notify("STOPPING=1")


def watchdog() -> bool:
    """Send one watchdog keep-alive ping (``WATCHDOG=1``)."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """Set the one-line status that ``systemctl status`` shows (``STATUS=``)."""
    return notify(f"STATUS={_one_line(text)}")


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings, or ``None`` if no watchdog applies to us.

    Half of ``$WATCHDOG_USEC`` (converted to seconds), when that is a positive integer
    and ``$WATCHDOG_PID`` is unset or equals this process's id (a child process that
    inherited the environment must not ping for its parent).
    """
    raw_usec = os.environ.get("WATCHDOG_USEC")
    if raw_usec is None:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        log.debug("sd_notify: ignoring malformed WATCHDOG_USEC=%r", raw_usec)
        return None
    if usec <= 0:
        return None
    raw_pid = os.environ.get("WATCHDOG_PID")
    if raw_pid is not None:
        try:
            pid = int(raw_pid)
        except ValueError:
            log.debug("sd_notify: ignoring malformed WATCHDOG_PID=%r", raw_pid)
            return None
        if pid != os.getpid():
            return None
    return usec / 2_000_000


class Watchdog:
    """Pings the systemd watchdog from an asyncio event loop.

    Run :meth:`run` as a task next to the daemon's main loop and cancel it on
    shutdown. Because the pings come from the event loop, a loop that blocks stops
    them and systemd restarts the service. ``healthy``, if given, is called before
    each ping and a ``False`` withholds it: pass a check that the step loop has made
    progress recently to catch a loop that is alive but stuck. ``interval=None``
    takes :func:`watchdog_interval`; with no watchdog configured :meth:`run` returns
    at once.
    """

    def __init__(
        self,
        interval: float | None = None,
        *,
        healthy: Callable[[], bool] | None = None,
    ) -> None:
        if interval is not None and not interval > 0:
            raise ValueError(f"watchdog interval must be positive, got {interval!r}")
        self.interval = watchdog_interval() if interval is None else interval
        self.healthy = healthy

    async def run(self) -> None:
        """Ping ``WATCHDOG=1`` every ``interval`` seconds until cancelled."""
        if self.interval is None:
            return
        while True:
            if self.healthy is None or self.healthy():
                # Never block the event loop: if systemd's queue is full, this ping is
                # dropped and the next one, well inside the timeout, goes out instead.
                _send(("WATCHDOG=1",), timeout=0.0)
            else:
                log.warning("sd_notify: step loop unhealthy; withholding the watchdog ping")
            await asyncio.sleep(self.interval)
