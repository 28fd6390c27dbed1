"""How the scheduler's frontend hands replies to its ROUTER socket without ever losing one
silently: :class:`ReplyOutbox`.

The socket is ``ROUTER_MANDATORY``, so a reply that cannot go out raises instead of
vanishing: ``EAGAIN`` when the pipe to that client is full (it has not read for a
long time), ``EHOSTUNREACH`` when the client is gone. A reply to a full pipe waits in
that client's backlog, in order, and is retried every few milliseconds; every later
reply to that client queues behind it. A backlog beyond ``max_backlog_bytes`` means
the client has stopped reading: the backlog is dropped, logged, and ``on_overflow``
is told (the frontend aborts that client's requests, so no work continues for it).

A client that asked for it (``Ping(sequenced=True)``) gets every reply with its
number (a second frame, 8 bytes big-endian, from 0), a number taken whether or not the
reply could be delivered: a reply dropped here, or anywhere between here and the
client, leaves a gap that the client sees at its next reply, and it fails the calls
that waited instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from ipc.schema import ServerMessage, encode

__all__ = ["RETRY_S", "ReplyOutbox", "seq_frame"]

log = logging.getLogger("expeditor.scheduler")

RETRY_S = (0.002, 0.05)
"""First and longest wait before sending a client's backlog again (doubling between)."""


ENTRY_BYTES = 256
"""What a held reply costs besides its payload (its list and frame objects): counted so
that a backlog of many small replies is bounded in memory, not only in payload."""


def _held_bytes(frames: list[bytes]) -> int:
    return len(frames[1]) + ENTRY_BYTES


def seq_frame(number: int) -> bytes:
    """The frame that numbers a reply (8 bytes, big-endian)."""
    return number.to_bytes(8, "big")


class _Backlog:
    __slots__ = ("frames", "size")

    def __init__(self) -> None:
        self.frames: deque[list[bytes]] = deque()
        self.size = 0


class ReplyOutbox:
    """Every reply of one ROUTER socket: numbered for the clients that asked, sent without
    blocking, held back (bounded) for a client whose pipe is full."""

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        max_backlog_bytes: int,
        on_overflow: Callable[[bytes], None],
    ) -> None:
        self.socket = socket
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.max_backlog_bytes = max_backlog_bytes
        self.on_overflow = on_overflow
        self.numbers: dict[bytes, int] = {}
        """Client -> number of its next reply (clients that asked for numbering)."""
        self.backlogs: dict[bytes, _Backlog] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._retry_s = RETRY_S[0]
        self.dropped = 0
        """Replies that could not be delivered (client gone, or its backlog overflowed)."""

    def sequence(self, client: bytes) -> None:
        """Number the replies to ``client`` from now on (from 0 if it was not numbered)."""
        self.numbers.setdefault(client, 0)

    def forget(self, client: bytes) -> None:
        """The client is gone: drop its numbering and backlog."""
        self.numbers.pop(client, None)
        backlog = self.backlogs.pop(client, None)
        if backlog is not None:
            self.dropped += len(backlog.frames)

    def send(self, client: bytes, message: ServerMessage) -> None:
        """Send ``message`` to ``client`` now, or queue it behind the client's backlog."""
        frames = [client, encode(message)]
        number = self.numbers.get(client)
        if number is not None:
            frames.append(seq_frame(number))
            self.numbers[client] = number + 1
        backlog = self.backlogs.get(client)
        if backlog is None:
            outcome = self._try_send(frames)
            if outcome != "full":
                return
            backlog = self.backlogs[client] = _Backlog()
        backlog.frames.append(frames)
        backlog.size += _held_bytes(frames)
        if backlog.size > self.max_backlog_bytes:
            self._overflow(client, backlog)
            return
        self._schedule_retry()

    def _try_send(self, frames: list[bytes]) -> str:
        """``sent``, ``full`` (the pipe to that client is full) or ``gone``."""
        sent = self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        if not sent.done():  # another send was waiting (never here): it finishes later
            sent.add_done_callback(_log_late_failure)
            return "sent"
        error = sent.exception()
        if error is None:
            return "sent"
        if isinstance(error, zmq.Again):
            return "full"
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            self.dropped += 1
            log.debug("dropped a reply for a client that is gone")
            return "gone"
        self.dropped += 1
        log.warning("dropped a reply that could not be sent: %r", error)
        return "gone"

    def _overflow(self, client: bytes, backlog: _Backlog) -> None:
        del self.backlogs[client]
        self.dropped += len(backlog.frames)
        log.warning(
            "dropped %d replies (%d bytes) for a client that reads nothing "
            "(max_reply_backlog_bytes=%d); aborting its requests",
            len(backlog.frames),
            backlog.size,
            self.max_backlog_bytes,
        )
        self.on_overflow(client)

    def _schedule_retry(self) -> None:
        if self._retry is None:
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(self._retry_s, self._flush)

    def _flush(self) -> None:
        """Send what each backlog can, in order; retry later while any is left."""
        self._retry = None
        progressed = False
        for client, backlog in list(self.backlogs.items()):
            while backlog.frames:
                outcome = self._try_send(backlog.frames[0])
                if outcome == "full":
                    break
                progressed = True
                frames = backlog.frames.popleft()
                backlog.size -= _held_bytes(frames)
            if not backlog.frames and self.backlogs.get(client) is backlog:
                del self.backlogs[client]
        if self.backlogs:
            self._retry_s = RETRY_S[0] if progressed else min(2 * self._retry_s, RETRY_S[1])
            self._schedule_retry()
        else:
            self._retry_s = RETRY_S[0]

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None


def _log_late_failure(future: asyncio.Future[object]) -> None:
    if not future.cancelled() and (error := future.exception()) is not None:
        log.warning("a reply could not be sent: %r", error)
