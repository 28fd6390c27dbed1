"""Data-parallel replicas behind one gateway (``[gateway] replica_frontends``, what
``serve --data-parallel-size N`` sets): which replica runs a request.

**Prefix affinity from the replicas' own KV events.** The gateway subscribes to each
replica's KV events (``replica_kv_events``; :mod:`ipc.kv_events`) and keeps, per
replica, the set of block hashes it has cached on either tier: exactly the replica's
prefix cache, since the events describe it exactly. A prompt's full blocks hash the way
the prefix cache hashes them (:func:`~scheduler_svc.core.block_pool.chain_hash`), so
the number of leading blocks a replica holds is a lookup per block.

**Least loaded.** Each replica's load is the requests this gateway has in flight on it.
A request goes to the replica holding the longest prefix of its prompt, unless that one
has ``max(IMBALANCE_MIN, IMBALANCE_RATIO x)`` more requests in flight than the least
loaded (then the least loaded takes it, as SGLang's router balances); with no prefix
anywhere, the least loaded (the first of equals in turn, so a cold start spreads).

**Failures.** A replica whose scheduler stops answering (a health check every
``HEALTH_INTERVAL_S``, or a request that failed with the server unavailable) gets no new
request until it answers again; the requests in flight on it fail with the client's
error (503 through the gateway), not a hang. When no replica answers, requests go to
the least loaded anyway and fail the same way.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from ipc.async_client import AsyncClient
from ipc.errors import UNREACHABLE, ServerError
from ipc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from ipc.schema import HealthState, HistogramData, MetricsReply
from scheduler_svc.core.block_pool import chain_hash
from scheduler_svc.core.kv_events import external_hash

__all__ = ["ReplicaRouter", "merge_replies"]

log = logging.getLogger("expeditor.gateway")

HEALTH_INTERVAL_S = 1.0
IMBALANCE_MIN = 4
IMBALANCE_RATIO = 2.0
UNAVAILABLE = (*UNREACHABLE, ServerError)


class ReplicaRouter:
    def __init__(self, clients: list[AsyncClient], kv_events: list[str]) -> None:
        """``kv_events``: each replica's KV-event endpoint, in the clients' order (empty:
        balance by load alone)."""
        if kv_events and len(kv_events) != len(clients):
            raise ValueError(
                f"replica_kv_events: {len(kv_events)} endpoints for {len(clients)} replicas"
            )
        self.clients = clients
        self.kv_events = kv_events
        self.block_size = 0
        """The replicas' KV block size, as their events say (0 until one is stored)."""
        self.load = [0] * len(clients)
        """Requests in flight on each replica through this gateway."""
        self.cached: list[set[tuple[str | None, int]]] = [set() for _ in clients]
        """Per replica, the (medium, block hash) pairs its prefix cache holds."""
        self.up = [True] * len(clients)
        self.prefix_routed = 0
        """Requests sent to a replica for its cached prefix."""
        self._turn = 0
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        for index, endpoint in enumerate(self.kv_events):
            self._tasks.append(asyncio.ensure_future(self._follow(ctx, index, endpoint)))
        self._tasks.append(asyncio.ensure_future(self._check_health()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- choosing ---------------------------------------------------------------------------

    def matched_blocks(self, token_ids: list[int]) -> list[int]:
        """Per replica, how many leading full blocks of ``token_ids`` it holds."""
        bs = self.block_size
        matched = [0] * len(self.clients)
        if not bs:
            return matched
        live = [i for i, held in enumerate(self.cached) if held]
        parent = 0
        for index in range(len(token_ids) // bs):
            if not live:
                break
            parent = chain_hash(parent, tuple(token_ids[index * bs : (index + 1) * bs]))
            key = external_hash(parent)
            live = [
                i for i in live if ("GPU", key) in self.cached[i] or ("CPU", key) in self.cached[i]
            ]
            for i in live:
                matched[i] = index + 1
        return matched

    def pick(self, token_ids: list[int] | None) -> int:
        """The replica for a request with these prompt ids (None: not known)."""
        candidates = [i for i, up in enumerate(self.up) if up] or list(range(len(self.clients)))
        load = self.load
        least = min(load[i] for i in candidates)
        idle = [i for i in candidates if load[i] == least]
        choice = idle[self._turn % len(idle)]
        self._turn += 1
        if token_ids and self.kv_events:
            matched = self.matched_blocks(token_ids)
            best = max(candidates, key=lambda i: (matched[i], -load[i]))
            bound = max(IMBALANCE_MIN, IMBALANCE_RATIO * least)
            if matched[best] and load[best] - least <= bound:
                choice = best
                self.prefix_routed += 1
        return choice

    def first_up(self) -> int:
        """A replica that answers (the first; 0 when none does), for lookups that are
        no request: nothing is counted."""
        return next((i for i, up in enumerate(self.up) if up), 0)

    def failed(self, index: int, exc: BaseException) -> None:
        """A request on replica ``index`` failed: if its scheduler is unavailable, send
        it nothing more until a health check answers."""
        if isinstance(exc, UNAVAILABLE) and self.up[index]:
            self.up[index] = False
            log.warning("replica %d unavailable (%s): no new requests until it answers", index, exc)

    # -- following the replicas ------------------------------------------------------------

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(i) for i in range(len(self.clients))))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _probe(self, index: int) -> None:
        try:
            status = await self.clients[index].health(timeout=HEALTH_INTERVAL_S * 2)
            up = (
                status.status in (HealthState.OK, HealthState.DEGRADED) and status.workers_ready > 0
            )
        except UNAVAILABLE:
            up = False
        if up != self.up[index]:
            log.warning("replica %d %s", index, "answers again" if up else "does not answer")
        self.up[index] = up

    async def _follow(self, ctx: zmq.asyncio.Context, index: int, endpoint: str) -> None:
        """Keep replica ``index``'s cached-block set from its KV events. A gap in the
        sequence numbers (batches dropped) or a restarted publisher (its numbers start
        over) makes the set unreliable: it is emptied and refilled as blocks are stored
        again (affinity is only a preference; nothing is lost)."""
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        expected: int | None = None
        held = self.cached[index]
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if expected is not None and seq != expected:
                    held.clear()
                expected = seq + 1
                try:
                    batch = decode_batch(frames[2])
                except msgspec.ValidationError as exc:
                    log.warning("replica %d: a KV event batch that does not decode: %s", index, exc)
                    continue
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        self.block_size = event.block_size
                        held.update((event.medium, h) for h in event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        held.difference_update((event.medium, h) for h in event.block_hashes)
                    elif isinstance(event, AllBlocksCleared):
                        held.clear()
        finally:
            sock.close(linger=0)


def merge_replies(replies: list[MetricsReply]) -> MetricsReply:
    """The replicas' metrics as one server's (``/metrics`` with replicas): counts and
    histograms summed, usage shares averaged, the cache config of the first with its
    block counts summed."""
    first = replies[0]
    fields: dict[str, object] = {}
    for name in MetricsReply.__struct_fields__:
        values = [getattr(r, name) for r in replies]
        sample = values[0]
        if name == "model":
            fields[name] = sample
        elif name.endswith("_perc"):
            fields[name] = sum(values) / len(values)
        elif isinstance(sample, int | float):
            fields[name] = sum(values)
        elif name == "spec_decode_num_accepted_tokens_per_pos":
            width = max(len(v) for v in values)
            fields[name] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        elif name == "histograms":
            fields[name] = {
                key: _sum_histograms([r.histograms[key] for r in replies if key in r.histograms])
                for key in sample
            }
        elif name == "cache_config":
            config = dict(sample)
            for key in ("num_gpu_blocks", "num_cpu_blocks"):
                if key in config:
                    config[key] = str(sum(int(r.cache_config.get(key, 0)) for r in replies))
            fields[name] = config
        else:  # counts by label
            merged: dict[str, int] = {}
            for value in values:
                for key, count in value.items():
                    merged[key] = merged.get(key, 0) + count
            fields[name] = merged
    return msgspec.structs.replace(first, **fields)


def _sum_histograms(parts: list[HistogramData]) -> HistogramData:
    return HistogramData(
        bounds=parts[0].bounds,
        counts=[sum(column) for column in zip(*(p.counts for p in parts), strict=True)],
        sum=sum(p.sum for p in parts),
        count=sum(p.count for p in parts),
    )
