"""Running a blocking call so that a call blocked for good fails its test instead of
hanging the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

SAFETY_S = 30.0
"""How long a blocking call may take before the test fails: a safety net against a
hang, far beyond what any of these calls needs."""

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
