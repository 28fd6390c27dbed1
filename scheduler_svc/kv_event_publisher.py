"""Publishing the prefix cache's KV events (``kv_events_endpoint``): a ZeroMQ PUB socket
in vLLM's wire format (:mod:`ipc.kv_events`), and an optional replay socket for a
subscriber that missed sequence numbers.

The daemon calls :meth:`KVEventPublisher.publish` after every step with what the core
recorded (:class:`~scheduler_svc.core.kv_events.KVEventLog`); a step that changed
nothing publishes nothing. Sends never block the step loop: a subscriber too slow for
the PUB socket's high-water mark loses batches, sees the gap in the sequence numbers
and asks the replay socket for them (the last ``kv_events_buffer_steps`` batches are
kept). A replay reply is framed as the PUB socket's messages, ``[topic, seq, payload]``
after the DEALER's empty delimiter, and ends with ``[b"", -1, b""]``, as vLLM's
publisher frames it (and vllm-router reads it).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from ipc.kv_events import END_SEQ, KVEventBatch, encode_batch, from_core
from scheduler_svc.core.kv_events import KVEventLog
from shared.errors import ConfigError

__all__ = ["KVEventPublisher"]

log = logging.getLogger("expeditor.scheduler")


class KVEventPublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        topic: str,
        replay_endpoint: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        connect: bool = False,
    ) -> None:
        """``connect``: the PUB socket connects to ``endpoint`` (a subscriber that binds,
        as llm-d's indexer does) instead of binding it."""
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        if connect:
            self.pub = ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.connect(endpoint)  # ZeroMQ reconnects by itself while it is away
            self.endpoint = f"{endpoint} (connected)"
        else:
            self.pub = _bound(ctx, zmq.PUB, endpoint, "kv_events_endpoint")
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self.replay = _bound(ctx, zmq.ROUTER, replay_endpoint, "kv_events_replay_endpoint")
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        """The latest batches, (sequence number, payload), for the replay socket."""
        self.num_dropped = 0
        """Batches the PUB socket could not take (its high-water mark was reached)."""
        log.info(
            "KV events on %s%s, topic %r",
            self.endpoint,
            f" (replay on {self.replay_endpoint})" if self.replay else "",
            topic,
        )

    def publish(self, events: KVEventLog) -> None:
        """Send what ``events`` recorded since the last call, as one batch."""
        recorded = events.take()
        if not recorded:
            return
        batch = KVEventBatch(
            time.time(), from_core(recorded, events.block_size), self.data_parallel_rank
        )
        payload = encode_batch(batch)
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart(
                (self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK, copy=False
            )
        except zmq.Again:
            self.num_dropped += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (nothing to do without the socket)."""
        if self.replay is None:
            return
        while True:
            frames = await self.replay.recv_multipart()
            identity, start = frames[0], frames[-1]
            if len(start) != 8:
                log.warning("KV event replay: a request of %d bytes, not 8: ignored", len(start))
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.replay.send_multipart(
                        (identity, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            await self.replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def _bound(ctx: zmq.asyncio.Context, kind: int, address: str, field: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close()
        raise ConfigError(f"{field}: cannot bind {address}: {exc}", field=field) from None
    return sock
