"""Running a blocking call, or waiting for a condition, so that one blocked for good
fails its test instead of hanging the suite (how long: :mod:`support.limits`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from support.limits import SAFETY_S, SERVE_SAFETY_S

T = TypeVar("T")


def in_thread(call: Callable[[], T]) -> T:
    """``call()`` in a daemon thread; its result, or its exception re-raised. Fails the
    test if it has not returned after SAFETY_S."""
    outcome: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(SAFETY_S)
    if thread.is_alive():
        pytest.fail(f"still blocked after {SAFETY_S:g} s")
    if errors:
        raise errors[0]
    return outcome[0]


def until(
    condition: Callable[[], T | None],
    what: str,
    timeout_s: float = SERVE_SAFETY_S,
    interval_s: float = 0.02,
) -> T:
    """Call ``condition`` until it returns something true; that value. Fails the test,
    naming ``what``, once ``timeout_s`` have passed."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)
    return value


async def until_async(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    timeout_s: float = SERVE_SAFETY_S,
    interval_s: float = 0.01,
) -> T:
    """Await ``probe()`` until it returns something (not None); that value. Fails the
    test, naming ``what``, once ``timeout_s`` have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (found := await probe()) is None:
        if loop.time() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(interval_s)
    return found
