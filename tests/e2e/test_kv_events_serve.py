"""End to end: ``serve --kv-events-endpoint`` publishes the prefix cache's events in
vLLM's wire format, gap-free, their hashes naming exactly the tokens they carry, and the
replay socket resends what a late subscriber missed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import zmq
from support.kv_event_sub import drain_stored

from ipc.client import AsyncClient
from ipc.kv_events import END_SEQ, AllBlocksCleared, BlockStored, decode_batch
from scheduler_svc.core.block_pool import chain_hash
from scheduler_svc.core.kv_events import external_hash
from scheduler_svc.launch import free_port, running_server

BS = 16
SYSTEM = list(range(200, 200 + 3 * BS))
"""A shared prefix of three full blocks."""


def _replay(ctx: zmq.Context, address: str, start: int, topic: bytes) -> list[tuple[int, bytes]]:
    """Every batch the replay socket at ``address`` keeps from ``start`` on, each framed
    as the PUB socket's (``topic`` included), then the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        assert sock.poll(10_000), "the replay socket did not answer"
        _, frame_topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            assert (frame_topic, payload) == (b"", b"")
            break
        assert frame_topic == topic
        batches.append((int.from_bytes(seq, "big"), payload))
    sock.close(linger=0)
    return batches


def _expected_hashes(tokens: list[int]) -> list[int]:
    hashes, parent = [], 0
    for index in range(len(tokens) // BS):
        parent = chain_hash(parent, tuple(tokens[index * BS : (index + 1) * BS]))
        hashes.append(external_hash(parent))
    return hashes


def test_served_kv_events_describe_the_cached_prompts(model: Path) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    topic = "kv@127.0.0.1:8000@tiny"
    flags = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
    flags += ("--kv-events-topic", topic, "--block-size", str(BS), "--num-gpu-blocks", "64")
    ctx = zmq.Context()
    with running_server(model, *flags) as (address, _):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.connect(pub)
        time.sleep(0.5)  # the subscription reaches the publisher

        async def requests() -> None:
            async with AsyncClient(address, timeout=60) as client:
                await client.generate(prompt_token_ids=[*SYSTEM, 1, 2], max_tokens=2)
                await client.generate(prompt_token_ids=[*SYSTEM, 3, 4, 5], max_tokens=2)

        asyncio.run(requests())
        live: list[tuple[int, bytes]] = []
        while sub.poll(1000):
            frame_topic, seq, payload = sub.recv_multipart()
            assert frame_topic == topic.encode()
            live.append((int.from_bytes(seq, "big"), payload))
        # From the first batch, sent before we came.
        everything = _replay(ctx, replay, 0, topic.encode())
        sub.close(linger=0)
    ctx.term()

    assert [seq for seq, _ in everything] == list(range(len(everything)))  # gap-free
    assert live and live == everything[-len(live) :]  # the replay resends the same bytes
    batches = [decode_batch(payload) for _, payload in everything]
    assert batches[0].events == [AllBlocksCleared()]  # a subscriber starts from nothing
    stored = [e for batch in batches for e in batch.events if isinstance(e, BlockStored)]
    # The first request stores the prefix's three blocks in one event (one chain, the
    # parent of its first block none); the second hits them and stores nothing of them.
    assert stored[0].block_hashes == _expected_hashes(SYSTEM)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == SYSTEM
    assert stored[0].block_size == BS and stored[0].medium == "GPU"
    announced = [h for e in stored for h in e.block_hashes]
    assert len(announced) == len(set(announced))
    for event in stored:
        assert len(event.token_ids) == BS * len(event.block_hashes)
        assert all(0 <= h < 2**63 for h in event.block_hashes)
    # Each event a tagged map on the wire (vllm-router refuses positional arrays).
    raw = msgspec.msgpack.decode(everything[1][1])
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # dp_rank, as vLLM's
    assert all(isinstance(e, dict) and "type" in e for e in raw[1])
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"} <= set(
        raw[1][0]
    )


def test_kv_events_connect_to_a_subscriber_that_binds(model: Path) -> None:
    """kv_events_connect: the scheduler's PUB socket connects to a central subscriber
    (llm-d's endpoint picker binds its SUB socket and every pod connects to it)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    flags = ("--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--kv-events-connect")
    flags += ("--block-size", str(BS), "--num-gpu-blocks", "64")
    with running_server(model, *flags) as (address, _):
        # A bound SUB socket sends its subscription to a PUB that connected only when
        # it handles its commands (a poll or a receive): a subscriber polls all along.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            sub.poll(100)

        async def request() -> None:
            async with AsyncClient(address, timeout=60) as client:
                await client.generate(prompt_token_ids=[*SYSTEM, 1, 2], max_tokens=2)

        asyncio.run(request())
        stored = drain_stored(sub)
    sub.close(linger=0)
    ctx.term()
    assert [h for e in stored for h in e.block_hashes] == _expected_hashes(SYSTEM)
