"""End to end: ``serve --data-parallel-size 2 --http`` on the tiny model. Two replicas
(each a scheduler with its worker), the gateway spreading requests over them with
prefix affinity from their KV events; outputs token-exact with transformers; a killed
worker loses nothing (its replica re-queues), a killed scheduler fails its requests in
flight with an error while the other replica serves, and comes back."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import openai
import pytest
import zmq
from support.hf_reference import Oracle
from support.serve import children_in_role, running_http_serve

from ipc.client import Client
from ipc.kv_events import decode_batch
from scheduler_svc.launch import free_port, running_serve

MAX_TOKENS = 8
PROMPTS = [[1, *range(10 + 7 * i, 30 + 7 * i)] for i in range(8)]
SYSTEM = [3 + (7 * i) % 250 for i in range(4 * 16)]
"""A shared prefix of four blocks."""


@pytest.fixture(scope="module")
def expected(model: Path, hf_oracle: Oracle) -> list[list[int]]:
    return hf_oracle(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def served(model: Path):
    flags = ("--data-parallel-size", "2", "--num-gpu-blocks", "64", "--scheduler-timeout-s", "2")
    with running_http_serve(model, *flags) as (frontends, url, proc):
        yield frontends.split(","), url, proc


def _replica_schedulers(serve_pid: int) -> list[int]:
    replicas = children_in_role(serve_pid, "serve")
    assert len(replicas) == 2, replicas
    return [pid for replica in replicas for pid in children_in_role(replica, "scheduler")]


async def _greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    name = (await client.models.list()).data[0].id

    async def one(prompt: list[int]) -> list[int]:
        reply = await client.completions.create(
            model=name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        )
        return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def _generated(frontend: str) -> tuple[int, int]:
    """(generated tokens, prefix-cache hit tokens) of one replica."""
    with Client(frontend, timeout=30) as client:
        metrics = client.metrics()
    return metrics.generation_tokens, metrics.prefix_cache_hits


def test_two_replicas_spread_requests_and_stay_exact(served, expected) -> None:
    frontends, url, _ = served
    before = [_generated(f)[0] for f in frontends]
    assert asyncio.run(_greedy(url, PROMPTS)) == expected
    moved = [_generated(f)[0] - b for f, b in zip(frontends, before, strict=True)]
    assert sum(moved) == len(PROMPTS) * MAX_TOKENS
    assert all(m >= MAX_TOKENS for m in moved), moved  # both replicas served


def test_a_text_prompt_gets_what_the_scheduler_would_generate(served) -> None:
    """With replicas the gateway tokenizes a text prompt to route it and sends its ids:
    the output is the scheduler's own for the text."""
    frontends, url, _ = served
    text = "A text prompt, tokenized once"
    with Client(frontends[0], timeout=60) as client:
        direct = client.generate(text, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    async def through_gateway() -> tuple[list[int], int]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        name = (await client.models.list()).data[0].id
        reply = await client.completions.create(
            model=name, prompt=text, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        await client.close()
        tokens = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
        return tokens, reply.usage.prompt_tokens

    tokens, prompt_tokens = asyncio.run(through_gateway())
    assert tokens == direct.token_ids
    assert prompt_tokens == len(direct.prompt_token_ids)


def test_a_shared_prefix_goes_where_it_is_cached(served) -> None:
    frontends, url, _ = served
    hits_before = [_generated(f)[1] for f in frontends]
    for index in range(4):  # one at a time: the replicas are equally idle each time
        asyncio.run(_greedy(url, [[*SYSTEM, 260 + index]]))
        time.sleep(0.3)  # the KV events reach the gateway
    hits = [_generated(f)[1] - b for f, b in zip(frontends, hits_before, strict=True)]
    # Round-robin would send two of the later three to the other replica (one miss);
    # affinity sends all three to the replica that cached the prefix.
    assert sum(hits) == 3 * len(SYSTEM), hits


def test_a_killed_worker_loses_nothing(served, expected) -> None:
    _, url, proc = served

    async def scenario() -> list[list[int]]:
        work = asyncio.ensure_future(_greedy(url, PROMPTS * 2))
        await asyncio.sleep(0.5)
        replica = children_in_role(proc.pid, "serve")[1]
        (worker,) = children_in_role(replica, "worker")
        os.kill(worker, signal.SIGKILL)  # the replica's serve restarts it
        return await work

    assert asyncio.run(scenario()) == expected * 2


def test_a_killed_scheduler_fails_its_requests_and_the_other_replica_serves(served, expected):
    frontends, url, proc = served
    victim = _replica_schedulers(proc.pid)[1]

    async def scenario() -> tuple[list[object], list[list[int]]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        name = (await client.models.list()).data[0].id
        long = [
            asyncio.ensure_future(
                client.completions.create(
                    model=name,
                    prompt=p,
                    max_tokens=200,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            for p in PROMPTS[:4]
        ]
        await asyncio.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        async with asyncio.timeout(60):  # no request hangs
            outcomes = await asyncio.gather(*long, return_exceptions=True)
            await asyncio.sleep(3.0)  # the gateway's health check sees it gone
            after = await _greedy(url, PROMPTS[:4])
        await client.close()
        return outcomes, after

    outcomes, after = asyncio.run(scenario())
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert failed, "no request was on the killed replica"
    assert all(isinstance(o, openai.APIStatusError) and o.status_code == 503 for o in failed)
    assert len(failed) < len(outcomes)  # those on the other replica finished
    assert after == expected[:4]
    deadline = time.monotonic() + 120  # the replica is started again
    while time.monotonic() < deadline:
        schedulers = _replica_schedulers(proc.pid)
        if len(schedulers) == 2 and victim not in schedulers:
            try:
                if _generated(frontends[1]) is not None:
                    break
            except Exception:
                pass
        time.sleep(0.5)
    else:
        raise AssertionError("the killed replica did not come back")


def test_one_replica_of_several_on_its_own_addresses(model: Path, tmp_path: Path) -> None:
    """``serve --replica 1`` (one systemd instance per replica) runs replica 1 of 2 alone:
    frontend, KV events and HTTP port offset by its index, dp_rank 1 on its events, one
    worker."""
    port = free_port()
    flags = ["--data-parallel-size", "2", "--replica", "1", "--http", f"127.0.0.1:{port}"]
    flags += ["--frontend", f"ipc://{tmp_path}/fe.sock"]
    flags += ["--kv-events-endpoint", f"ipc://{tmp_path}/kv.sock"]
    ctx = zmq.Context()
    with running_serve(model, *flags, lines=2) as ((frontend, url), _):
        assert frontend == f"ipc://{tmp_path}/fe.sock.1"
        assert url == f"http://127.0.0.1:{port + 1}"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/kv.sock.1")
        time.sleep(0.5)  # the subscription reaches the publisher
        assert asyncio.run(_greedy(url, PROMPTS[:1]))
        assert sub.poll(5000)
        _, _, payload = sub.recv_multipart()
        sub.close(linger=0)
        with Client(frontend, timeout=30) as client:
            state = client.inspect()
    ctx.term()
    assert decode_batch(payload).data_parallel_rank == 1
    assert [w.rank for w in state.workers] == [0]
