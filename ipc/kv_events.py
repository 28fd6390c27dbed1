"""KV-cache events on the wire: vLLM's schema (``vllm/distributed/kv_events.py``),
which the routers read (vllm-router's ``kv_aware`` policy, llm-d's KV-cache indexer,
Dynamo's KV router).

A message on the PUB socket is three frames: the topic, the batch's sequence number
(8 bytes, big-endian; 0, 1, 2, ... without gaps from the publisher's start) and a
msgpack payload, the :class:`KVEventBatch` ``[ts, [event, ...], data_parallel_rank]``.
Each event is a **tagged map**: ``{"type": "BlockStored", "block_hashes": [...], ...}``
(vLLM's own publisher writes events as positional arrays, which vllm-router refuses:
"KV event must be a tagged map"; a map decodes by field name either way).

The replay socket (ROUTER) answers a request frame holding a start sequence number (8
bytes, big-endian) with every buffered batch from there, each as ``[seq, payload]``,
then ``[END_SEQ, b""]``.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last frame: no more batches."""


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    """Blocks entered the cache on ``medium``: ``block_hashes`` in prefix order, the
    first one's parent ``parent_block_hash`` (None: it starts a prompt), their tokens
    ``token_ids`` (``block_size`` per block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    """Blocks left the cache on ``medium`` (evicted, not merely freed)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    """Everything cached is gone (the publisher started, or its workers were lost)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    """Seconds since the epoch, when the batch was published."""
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """A payload as a subscriber reads it (raises msgspec.ValidationError on a bad one)."""
    return _decoder.decode(payload)


def from_core(events: list[Any], block_size: int) -> list[KVEvent]:
    """The core's records (:data:`scheduler_svc.core.kv_events.CacheEvent`, plain
    tuples) as wire events."""
    wire: list[KVEvent] = []
    for event in events:
        kind = event[0]
        if kind == "stored":
            _, medium, hashes, parent, tokens = event
            wire.append(BlockStored(hashes, parent, tokens, block_size, None, medium))
        elif kind == "removed":
            wire.append(BlockRemoved(event[2], event[1]))
        else:
            wire.append(AllBlocksCleared())
    return wire
