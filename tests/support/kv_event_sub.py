"""Reading a KV event publisher from a test: the BlockStored events a SUB socket gets."""

from __future__ import annotations

import zmq

from ipc.kv_events import BlockStored, decode_batch


def drain_stored(sub: zmq.Socket, wait_ms: int = 2000) -> list[BlockStored]:
    """Every BlockStored event of the batches ``sub`` receives until it has been quiet
    for ``wait_ms`` (frames ``[topic, seq, payload]``)."""
    stored: list[BlockStored] = []
    while sub.poll(wait_ms):
        _, _, payload = sub.recv_multipart()
        stored += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
    return stored
