"""How the client's calls wait: their timeouts (:data:`DEFAULT_TIMEOUT`, :data:`Timeout`
and the checks of seconds) and the queues of futures that wait for a reply (the abort
and control calls of :class:`~ipc.async_client.AsyncClient`)."""

from __future__ import annotations

import asyncio
import enum
import math
from collections import deque
from typing import Any, TypeVar

__all__ = [
    "DEFAULT_TIMEOUT",
    "ControlEntry",
    "Timeout",
    "check_seconds",
    "check_timeout",
    "discard",
    "head_entry",
    "pop_entry",
    "pop_oldest",
    "pop_waiter",
]

_T = TypeVar("_T")


class _Default(enum.Enum):
    TIMEOUT = "the client's timeout"


DEFAULT_TIMEOUT = _Default.TIMEOUT
"""Sentinel for a call's ``timeout``: use the client's own ``timeout``."""

Timeout = float | None | _Default
"""A call's timeout: seconds, ``None`` (wait forever) or :data:`DEFAULT_TIMEOUT`."""

ControlEntry = tuple[int, "asyncio.Future[Any]"]
"""A waiting inspect/health/ping call: (send order, future of its reply)."""


def check_seconds(name: str, value: float) -> float:
    """``value`` as float seconds: a positive finite number, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name}: must be a positive finite number, got {value!r}")
    return float(value)


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout: must be a positive number or None, got {timeout!r}")
    return float(timeout)


def head_entry(
    waiters: deque[ControlEntry],
) -> ControlEntry | None:
    """The oldest waiter still waiting (done ones are dropped on the way)."""
    while waiters and waiters[0][1].done():
        waiters.popleft()
    return waiters[0] if waiters else None


def pop_entry(
    waiters: deque[ControlEntry],
) -> ControlEntry | None:
    entry = head_entry(waiters)
    if entry is not None:
        waiters.popleft()
    return entry


def pop_oldest(all_waiters: dict[type[Any], deque[ControlEntry]]) -> ControlEntry | None:
    """Remove and return the control call that has waited longest, of every kind."""
    oldest: ControlEntry | None = None
    for waiters in all_waiters.values():
        head = head_entry(waiters)
        if head is not None and (oldest is None or head[0] < oldest[0]):
            oldest = head
    if oldest is not None:
        for waiters in all_waiters.values():
            if waiters and waiters[0] is oldest:
                waiters.popleft()
                break
    return oldest


def pop_waiter(waiters: deque[asyncio.Future[_T]] | None) -> asyncio.Future[_T] | None:
    while waiters:
        future = waiters.popleft()
        if not future.done():
            return future
    return None


def discard(waiters: deque[Any], item: object) -> None:
    try:
        waiters.remove(item)
    except ValueError:
        pass
