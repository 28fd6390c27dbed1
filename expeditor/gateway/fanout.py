"""Running the scheduler requests of one HTTP request (a prompt batch) without stalling
the gateway's event loop: they are started one at a time, with a turn of the loop
between two starts (so other users' replies and requests go on), and at most
:data:`IN_FLIGHT_PER_REQUEST` at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["IN_FLIGHT_PER_REQUEST", "fan_out"]

IN_FLIGHT_PER_REQUEST = 256
"""Most scheduler requests one HTTP request has in flight at once (the rest of its
batch starts as those finish)."""

_T = TypeVar("_T")


async def fan_out(
    count: int, work: Callable[[int], Awaitable[_T]], in_flight: int = IN_FLIGHT_PER_REQUEST
) -> list[_T]:
    """``work(0)`` ... ``work(count - 1)``, concurrently, started one at a time with a
    yield to the loop after each start, at most ``in_flight`` running; their results in
    order. The first failure (or a cancellation) cancels the others and is raised."""
    slots = asyncio.Semaphore(in_flight)
    failed: list[Exception] = []

    async def one(index: int) -> _T:
        try:
            return await work(index)
        except Exception as exc:
            failed.append(exc)
            raise
        finally:
            slots.release()

    tasks: list[asyncio.Future[_T]] = []
    try:
        for index in range(count):
            await slots.acquire()
            if failed:  # a failure ends the batch before more start
                raise failed[0]
            tasks.append(asyncio.ensure_future(one(index)))
            await asyncio.sleep(0)
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
