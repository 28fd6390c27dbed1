"""What a KV-aware router asks a worker to find its KV events: ``GET /get_server_info``
(the cache identity: model, instance, block size) and ``GET /kv_event_sources`` (per
data-parallel rank, the ZeroMQ PUB socket and its topic).

vllm-router's ``kv_aware`` policy reads both for a worker given only by URL (no static
``--kv-event-source``): with them it subscribes to the scheduler's events by itself.
Only tcp:// publishers are listed (a router on another host cannot reach ipc://); a
bind address (``tcp://*:5557``, ``0.0.0.0``) is rewritten by the router to the worker's
host. A tcp:// replay socket (``kv_events_replay_endpoint``; each replica's behind
this gateway) is listed too: a router asks it for what it missed, including, when it
attaches to a server that already published, everything from the first batch kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response

from expeditor.gateway.http import check_api_key
from scheduler_svc.replica_supervisor import nth_endpoint
from shared.gateway_config import GatewayConfig
from shared.server_config import ServerConfig

if TYPE_CHECKING:
    from expeditor.gateway.app import Gateway

__all__ = ["add_discovery_routes", "kv_event_sources"]

SCHEMA_VERSION = 1


def kv_event_sources(server: ServerConfig, gateway: GatewayConfig) -> dict[str, dict[str, Any]]:
    """The /kv_event_sources body: data-parallel rank -> its publisher (with replicas
    behind this gateway, each replica is one rank; else the scheduler's own)."""
    replicas = gateway.replica_kv_event_list
    endpoints = replicas or [server.kv_events_endpoint]
    first_rank = 0 if replicas else server.data_parallel_rank
    sources = {}
    for offset, endpoint in enumerate(endpoints):
        if not endpoint.startswith("tcp://") or server.kv_events_connect:
            continue
        source: dict[str, Any] = {
            "endpoint": endpoint,
            "topic": server.kv_events_topic,
            "buffer_steps": server.kv_events_buffer_steps,
            "publisher": "zmq",
            "encoding": "msgpack",
            "schema_version": SCHEMA_VERSION,
            "enable_kv_cache_events": True,
        }
        replay = server.kv_events_replay_endpoint
        if replay and replicas:  # each replica's, as the supervisor derived it
            replay = nth_endpoint(replay, offset)
        if replay.startswith("tcp://"):
            source["replay_endpoint"] = replay
        sources[str(first_rank + offset)] = source
    return sources


def add_discovery_routes(
    app: FastAPI,
    gateway: Gateway,
    guard: Callable[[Awaitable[Response]], Awaitable[Response]],
    answer: Callable[[dict[str, Any]], Response],
) -> None:
    """The two routes on ``app``; ``guard`` turns their errors into HTTP errors."""
    instance = uuid.uuid4().hex
    """This gateway's incarnation: a router that sees it change starts a new index."""

    @app.get("/get_server_info")
    async def server_info(request: Request) -> Response:
        async def work() -> Response:
            check_api_key(request, gateway.api_key)
            model = await gateway.served_model()
            reply = await gateway.metrics_reply()
            body: dict[str, Any] = {
                "model_id": model.name,
                "model_path": model.path,
                "instance_id": instance,
                "max_model_len": model.max_model_len,
            }
            if "block_size" in reply.cache_config:
                body["kv_block_size"] = int(reply.cache_config["block_size"])
            return answer(body)

        return await guard(work())

    @app.get("/kv_event_sources")
    async def event_sources(request: Request) -> Response:
        async def work() -> Response:
            check_api_key(request, gateway.api_key)
            return answer(gateway.kv_event_sources)

        return await guard(work())
