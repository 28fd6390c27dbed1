"""A stream's output buffer, bounded: the events of a streamed response are produced
as fast as the scheduler generates them (the scheduler requests are read at once, so
nothing piles up unseen in the client's queues) and held here until the HTTP client
takes them. A client that does not read lets them pile up: beyond
``max_stream_buffer_bytes`` unsent the request is aborted (its scheduler generation
stops), with a logged reason, and the stream ends with an error event and
``[DONE]`` (which the client sees if it ever reads)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

from expeditor.gateway.responses import DONE, error_body, sse

__all__ = ["SEND_CHUNK_BYTES", "bounded_stream", "overflow_event"]

log = logging.getLogger("expeditor.gateway")

SEND_CHUNK_BYTES = 65_536
"""Events ready together are sent as one write of up to about this many bytes."""


def overflow_event(unsent: int, limit: int) -> bytes:
    """The error event that ends a stream its client did not read."""
    message = (
        f"the client did not read this stream: {unsent} bytes unsent, beyond "
        f"max_stream_buffer_bytes={limit}; the request was aborted"
    )
    return sse(error_body(message, "BadRequestError", 400, "stream"))


async def bounded_stream(
    source: AsyncIterator[bytes], limit: int, name: str
) -> AsyncIterator[bytes]:
    """The events of ``source`` (read eagerly by a task of its own), joined into
    writes of up to :data:`SEND_CHUNK_BYTES`; an exception ``source`` raises is raised
    here in its turn. Beyond ``limit`` bytes not taken yet, ``source`` is closed (which
    aborts its requests) and the overflow event and ``[DONE]`` end the stream."""
    buffer: deque[bytes] = deque()
    unsent = 0
    ended = False
    failure: Exception | None = None
    ready = asyncio.Event()

    async def fill() -> None:
        nonlocal unsent, ended, failure
        try:
            async for event in source:
                buffer.append(event)
                unsent += len(event)
                ready.set()
                if unsent > limit:
                    log.warning(
                        "stream %s aborted: its client left %d bytes unread "
                        "(max_stream_buffer_bytes=%d)",
                        name,
                        unsent,
                        limit,
                    )
                    # What the client never took is dropped: only the end is kept.
                    event = overflow_event(unsent, limit)
                    buffer.clear()
                    buffer.extend((event, DONE))
                    unsent = len(event) + len(DONE)
                    break
        except Exception as exc:
            failure = exc
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
            ended = True
            ready.set()

    task = asyncio.ensure_future(fill())
    try:
        while True:
            if buffer:
                chunk = _take(buffer)
                unsent = max(0, unsent - len(chunk))
                yield chunk
                continue
            if ended:
                if failure is not None:
                    raise failure
                return
            ready.clear()
            await ready.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _take(buffer: deque[bytes]) -> bytes:
    """The first events of ``buffer``, up to SEND_CHUNK_BYTES of them (at least one)."""
    first = buffer.popleft()
    if not buffer or len(first) >= SEND_CHUNK_BYTES:
        return first
    parts = [first]
    size = len(first)
    while buffer and size + len(buffer[0]) <= SEND_CHUNK_BYTES:
        event = buffer.popleft()
        parts.append(event)
        size += len(event)
    return b"".join(parts)
