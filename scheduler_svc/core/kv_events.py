"""KV-cache events: what the prefix cache stored and forgot, for routers outside the
process that route requests by the prefixes each replica holds.

The core records; the daemon publishes (:mod:`scheduler_svc.kv_event_publisher`, in
vLLM's wire format, :mod:`ipc.kv_events`). An event names blocks by their *external*
hash: the prefix cache's chained content hash (:func:`~scheduler_svc.core.block_pool.
chain_hash`) folded below 2^63, so it names a block's whole prefix, and the same
content has the same hash on every tier and every replica of one model (ints and tuples
of ints hash alike in every process). What the events say holds exactly:

- ``stored`` when a block enters the device prefix cache (``GPU``), or the host tier
  keeps a block the device cache evicts (``CPU``);
- ``removed`` when it leaves: a device block evicted by an allocation (a block merely
  freed stays cached and announced), a host-tier block overwritten by a newer one;
- ``cleared`` when both tiers forget everything: when recording starts, and when a
  worker was lost (the device cache went with it).

So an index built from the events alone equals the set of cached blocks after every
step (tests/core/test_kv_events.py checks it under random traces, worker losses
included). Two different prefixes whose folded hashes collide (a 2^-63 chance per
pair) would read as one block to a router; the cache itself confirms a hit by its key.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["EXTERNAL_HASH_MASK", "CacheEvent", "KVEventLog", "Medium", "external_hash"]

EXTERNAL_HASH_MASK = (1 << 63) - 1

Medium = Literal["GPU", "CPU"]
"""The device pool (whatever the device is), or the host tier (pinned CPU memory)."""

CacheEvent = (
    tuple[Literal["stored"], Medium, list[int], int | None, list[int]]
    | tuple[Literal["removed"], Medium, list[int]]
    | tuple[Literal["cleared"]]
)
"""("stored", medium, block hashes, parent hash of the first, their tokens in order),
("removed", medium, block hashes), ("cleared",)."""


def external_hash(block_hash: int) -> int:
    """A content hash as events carry it: non-negative, below 2^63."""
    return block_hash & EXTERNAL_HASH_MASK


class KVEventLog:
    """Events since the last :meth:`take`, consecutive ones merged as vLLM batches them:
    a store that continues the previous store's chain on the same tier joins it, and
    removals on one tier join."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[CacheEvent] = [("cleared",)]
        """Recording starts from nothing: a subscriber drops what it knew."""

    def stored(
        self, medium: Medium, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...]
    ) -> None:
        """``block_hash`` (its tokens after ``parent_hash``'s, None for a first block)
        is now cached on ``medium``."""
        ext = external_hash(block_hash)
        parent = None if parent_hash is None else external_hash(parent_hash)
        pending = self.pending
        if pending:
            last = pending[-1]
            if last[0] == "stored" and last[1] == medium and last[2][-1] == parent:
                last[2].append(ext)
                last[4].extend(tokens)
                return
        pending.append(("stored", medium, [ext], parent, list(tokens)))

    def removed(self, medium: Medium, block_hash: int) -> None:
        ext = external_hash(block_hash)
        pending = self.pending
        if pending:
            last = pending[-1]
            if last[0] == "removed" and last[1] == medium:
                last[2].append(ext)
                return
        pending.append(("removed", medium, [ext]))

    def cleared(self) -> None:
        """Both tiers forgot everything: earlier events no longer matter."""
        self.pending = [("cleared",)]

    def take(self) -> list[CacheEvent]:
        events, self.pending = self.pending, []
        return events


def apply_events(index: set[tuple[Medium, int]], events: list[CacheEvent]) -> None:
    """Fold ``events`` into ``index`` (the (medium, external hash) pairs cached): what a
    subscriber does (the tests check the index against the cache)."""
    for event in events:
        if event[0] == "cleared":
            index.clear()
        elif event[0] == "stored":
            index.update((event[1], h) for h in event[2])
        else:
            index.difference_update((event[1], h) for h in event[2])
