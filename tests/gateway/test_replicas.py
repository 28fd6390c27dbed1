"""The gateway's choice of replica (expeditor/gateway/replicas.py): least loaded, prefix
affinity from KV events within the imbalance bound, unavailable replicas skipped; the
replicas' metrics merged; a replica's cached blocks followed from its published events."""

from __future__ import annotations

import asyncio
import os
import time

import zmq.asyncio

from expeditor.gateway.replicas import IMBALANCE_MIN, ReplicaRouter, merge_replies
from ipc.errors import ServerUnavailableError
from ipc.schema import HistogramData, MetricsReply
from scheduler_svc.core.block_pool import chain_hash
from scheduler_svc.core.kv_events import KVEventLog, external_hash
from scheduler_svc.kv_event_publisher import KVEventPublisher

BS = 4
PROMPT = list(range(1, 1 + 3 * BS)) + [99]


def _hashes(tokens: list[int]) -> list[int]:
    out, parent = [], 0
    for index in range(len(tokens) // BS):
        parent = chain_hash(parent, tuple(tokens[index * BS : (index + 1) * BS]))
        out.append(external_hash(parent))
    return out


def router(n: int = 3) -> ReplicaRouter:
    r = ReplicaRouter([object()] * n, [f"ipc://unused{i}" for i in range(n)])  # type: ignore[list-item]
    r.block_size = BS
    return r


def test_least_loaded_in_turn_then_the_longest_cached_prefix() -> None:
    r = router()
    assert [r.pick(None) for _ in range(3)] == [0, 1, 2]  # idle replicas in turn
    r.load = [2, 0, 1]
    assert r.pick(PROMPT) == 1  # nothing cached anywhere: the least loaded
    r.cached[2] = {("GPU", h) for h in _hashes(PROMPT)[:2]}
    r.cached[0] = {("CPU", h) for h in _hashes(PROMPT)}  # the host tier counts too
    assert r.matched_blocks(PROMPT) == [3, 0, 2]
    assert r.pick(PROMPT) == 0 and r.prefix_routed == 1
    r.cached[0] = {("GPU", h) for h in _hashes(PROMPT)[1:]}  # no first block: no prefix
    assert r.matched_blocks(PROMPT) == [0, 0, 2]
    r.load = [0, 0, IMBALANCE_MIN]
    assert r.pick(PROMPT) == 2  # busier, but within the bound
    r.load = [0, 0, IMBALANCE_MIN + 1]
    assert r.pick(PROMPT) in (0, 1)  # beyond it: the least loaded


def test_an_unavailable_replica_gets_nothing_new() -> None:
    r = router(2)
    r.failed(1, ServerUnavailableError("ipc://x", 3.0))
    assert [r.pick(None) for _ in range(4)] == [0, 0, 0, 0]
    r.failed(0, ValueError("a bad request is not the replica's fault"))
    assert r.up == [True, False]
    r.up = [False, False]  # none answers: the least loaded anyway (and it fails fast)
    assert r.pick(None) in (0, 1)


def test_metrics_of_replicas_sum() -> None:
    def reply(tokens: int, usage: float, ttft: list[int]) -> MetricsReply:
        return MetricsReply(
            model="m", num_requests_running=1, num_requests_waiting=2, num_requests_swapped=0,
            kv_cache_usage_perc=usage, cpu_swap_usage_perc=0.0,
            num_preemptions={"swap": 1}, prompt_tokens=tokens, generation_tokens=tokens,
            prefix_cache_queries=tokens, prefix_cache_hits=1, request_success={"stop": 1},
            histograms={"time_to_first_token_seconds": HistogramData(
                bounds=[0.1], counts=ttft, sum=1.0, count=sum(ttft))},
            spec_decode_num_accepted_tokens_per_pos=[1, 2][: len(ttft)],
            cache_config={"block_size": "16", "num_gpu_blocks": "64"},
        )  # fmt: skip

    merged = merge_replies([reply(10, 0.5, [1, 2]), reply(5, 0.25, [3, 0])])
    assert (merged.generation_tokens, merged.num_requests_waiting) == (15, 4)
    assert merged.kv_cache_usage_perc == 0.375
    assert merged.num_preemptions == {"swap": 2} and merged.request_success == {"stop": 2}
    ttft = merged.histograms["time_to_first_token_seconds"]
    assert (ttft.counts, ttft.count, ttft.sum) == ([4, 2], 6, 2.0)
    assert merged.spec_decode_num_accepted_tokens_per_pos == [2, 4]
    assert merged.cache_config == {"block_size": "16", "num_gpu_blocks": "128"}


def test_the_router_follows_a_replicas_published_events(tmp_path) -> None:
    async def scenario() -> tuple[set, set, set]:
        ctx = zmq.asyncio.Context.instance()
        endpoint = f"ipc://{tmp_path}/kv.sock"
        publisher = KVEventPublisher(ctx, endpoint, topic="t")
        r = ReplicaRouter([object(), object()], [endpoint, f"ipc://{tmp_path}/none"])  # type: ignore[list-item]
        r._tasks = [asyncio.ensure_future(r._follow(ctx, 0, endpoint))]
        await asyncio.sleep(0.3)  # subscribed
        log = KVEventLog(block_size=BS)
        hashes = _hashes(PROMPT)
        parent = None
        for index, h in enumerate(hashes):
            log.stored("GPU", h, parent, tuple(PROMPT[index * BS : (index + 1) * BS]))
            parent = h
        publisher.publish(log)
        await _until(lambda: len(r.cached[0]) == 3)
        stored = set(r.cached[0])
        log.removed("GPU", hashes[2])
        publisher.publish(log)
        await _until(lambda: len(r.cached[0]) == 2)
        removed = set(r.cached[0])
        publisher.next_seq += 5  # batches lost: what the router knew is unreliable
        log.stored("GPU", hashes[0], None, tuple(PROMPT[:BS]))
        publisher.publish(log)
        await _until(lambda: len(r.cached[0]) == 1)
        after_gap = set(r.cached[0])
        await r.stop()
        publisher.close()
        return stored, removed, after_gap

    stored, removed, after_gap = asyncio.run(scenario())
    hashes = _hashes(PROMPT)
    assert stored == {("GPU", h) for h in hashes}
    assert removed == {("GPU", h) for h in hashes[:2]}
    assert after_gap == {("GPU", hashes[0])}


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the router never saw the events"
        await asyncio.sleep(0.02)


def test_replica_settings() -> None:
    import pytest

    from scheduler_svc.replica_supervisor import nth_endpoint
    from shared.errors import ConfigError
    from shared.gateway_config import GatewayConfig

    assert nth_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert nth_endpoint("ipc:///run/e/fe.sock", 1) == "ipc:///run/e/fe.sock.1"
    cfg = GatewayConfig(replica_frontends="ipc://a, ipc://b", replica_kv_events="ipc://x,ipc://y")
    assert cfg.replica_list == ["ipc://a", "ipc://b"]
    assert cfg.replica_kv_event_list == ["ipc://x", "ipc://y"]
    with pytest.raises(ConfigError, match=r"^replica_kv_events: 1 endpoints for 2 replica"):
        GatewayConfig(replica_frontends="ipc://a,ipc://b", replica_kv_events="ipc://x")


def test_each_replica_gets_its_addresses_and_devices(monkeypatch) -> None:
    import pytest

    from scheduler_svc.replica_supervisor import one_replica, replica_server
    from shared.errors import ConfigError
    from shared.gateway_config import GatewayConfig
    from shared.server_config import ServerConfig

    server = ServerConfig(
        data_parallel_size=2,
        tensor_parallel_size=2,
        device="cuda",
        frontend="tcp://127.0.0.1:6000",
        kv_events_endpoint="tcp://127.0.0.1:7000",
        insecure_tcp=True,
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    replica, env = replica_server(server, 1)
    assert env == {"CUDA_VISIBLE_DEVICES": "6,7"}  # two ranks each
    assert (replica.data_parallel_size, replica.data_parallel_rank) == (1, 1)
    assert replica.frontend == "tcp://127.0.0.1:6001"
    assert replica.kv_events_endpoint == "tcp://127.0.0.1:7001"
    assert replica.worker_endpoint == ""  # serve makes a private one
    cpu = ServerConfig(data_parallel_size=2, device="cpu")
    replica, env = replica_server(cpu, 0)
    assert env == {} and replica.cpu_threads == max(1, (os.cpu_count() or 1) // 2)
    _, gateway, _ = one_replica(cpu, GatewayConfig(port=8000), 1)
    assert gateway is not None and gateway.port == 8001
    with pytest.raises(ConfigError, match=r"^replica: 2 is not one of data_parallel_size 2"):
        one_replica(cpu, None, 2)


def test_kv_event_sources_list_what_each_replica_binds() -> None:
    """/kv_event_sources with replicas behind the gateway names, per rank, the PUB and
    replay sockets that replica's own configuration binds; a lone server its own; an
    ipc:// replay socket (no router on another host reaches it) none."""
    from expeditor.gateway.discovery import kv_event_sources
    from scheduler_svc.replica_supervisor import replica_server
    from shared.gateway_config import GatewayConfig
    from shared.server_config import ServerConfig

    server = ServerConfig(
        data_parallel_size=2,
        kv_events_endpoint="tcp://127.0.0.1:7000",
        kv_events_replay_endpoint="tcp://127.0.0.1:7100",
        device="cpu",
    )
    replicas = [replica_server(server, i)[0] for i in range(2)]
    gateway = GatewayConfig(
        replica_frontends="ipc://a,ipc://b",
        replica_kv_events=",".join(r.kv_events_endpoint for r in replicas),
    )
    sources = kv_event_sources(server, gateway)
    assert {rank: (s["endpoint"], s["replay_endpoint"]) for rank, s in sources.items()} == {
        str(r.data_parallel_rank): (r.kv_events_endpoint, r.kv_events_replay_endpoint)
        for r in replicas
    }
    assert sources["1"]["replay_endpoint"] == "tcp://127.0.0.1:7101"
    lone = ServerConfig(
        kv_events_endpoint="tcp://127.0.0.1:7000",
        kv_events_replay_endpoint="tcp://127.0.0.1:7100",
    )
    assert kv_event_sources(lone, GatewayConfig())["0"]["replay_endpoint"] == "tcp://127.0.0.1:7100"
    local = ServerConfig(
        kv_events_endpoint="tcp://127.0.0.1:7000", kv_events_replay_endpoint="ipc:///run/r"
    )
    assert "replay_endpoint" not in kv_event_sources(local, GatewayConfig())["0"]
