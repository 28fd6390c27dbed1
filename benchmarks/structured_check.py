"""Structured output at volume through ``expeditor serve --http`` on the real SmolLM2
checkpoint, with the official openai client: ``--requests`` chat requests, each with a
JSON schema drawn from the seeded family (expeditor/bench/schema_family.py: objects, nested
objects, arrays with item bounds, enums, bounded numbers, required fields,
``additionalProperties: false``), half greedy and half at temperature 1 (seeded), sent
``--concurrency`` at a time. Every completion that finished with ``stop`` must parse and
validate against its schema (``jsonschema``); one that finished with ``length`` must
have used all its ``max_tokens``. Prints the counts (and exits 1 on any failure).

Then, with ``--abuse-rounds`` N: the time to first token of a plain streamed request,
N times alone and N times with bad constraints in flight, interleaved; the medians and
their ratio. ``--abuse burst`` (the default): each measured request starts while one
request of each :data:`KINDS` is in flight (a schema with an unknown type, an
unsupported keyword, a 1 MB schema, the slowest-compiling schema we found: 2,000
alternatives); ``--abuse flood``: while ``--flooders`` processes send :data:`BAD`
requests back to back.

    .venv/bin/python benchmarks/structured_check.py [--requests 200] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.synchronize
import os
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.schemas import schemas
from support.serve import running_http_serve

NAME = "smollm2-135m-instruct"


async def run(url: str, family: list[dict], concurrency: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    counts = {"stop": 0, "length": 0, "invalid": 0, "failed": 0}
    problems: list[str] = []

    async def one(index: int, schema: dict) -> None:
        form = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}}
        messages = [{"role": "user", "content": f"A JSON object for: {json.dumps(schema)}"}]
        async with gate:
            try:
                reply = await client.chat.completions.create(
                    model=NAME, messages=messages, max_tokens=max_tokens, response_format=form,
                    temperature=0.0 if index % 2 else 1.0, seed=index,
                )  # fmt: skip
            except openai.OpenAIError as exc:
                counts["failed"] += 1
                problems.append(f"{index}: {exc}")
                return
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(choice.message.content), schema)
                counts["stop"] += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                counts["invalid"] += 1
                problems.append(f"{index}: {exc}: {choice.message.content!r}")
        elif reply.usage.completion_tokens == max_tokens:
            counts["length"] += 1
        else:
            counts["invalid"] += 1
            problems.append(
                f"{index}: {choice.finish_reason} after {reply.usage.completion_tokens}"
            )

    start = time.perf_counter()
    await asyncio.gather(*(one(i, s) for i, s in enumerate(family)))
    counts["seconds"] = round(time.perf_counter() - start, 1)
    return {"counts": counts, "problems": problems[:10]}


BAD = [
    {"guided_json": {"type": "object", "properties": {"a": {"type": "strng"}},
                     "description": "x" * 200_000}},
    {"guided_regex": "a(b" * 1000},
    {"guided_grammar": "root ::= " + " ".join(f"r{i}" for i in range(2000))},
]  # fmt: skip
"""Constraints the server refuses (400): a big schema with an unknown type, an
unbalanced regex, a grammar of undefined rules."""


def slow_schema(tag: str) -> dict:
    """The slowest-compiling schema found (2,000 alternatives, about 0.3 s here); ``tag``
    makes each one new to the compiler's cache."""
    return {"anyOf": [
        {"type": "object", "properties": {f"{tag}{i}": {"type": "integer"}},
         "required": [f"{tag}{i}"]}
        for i in range(2000)]}  # fmt: skip


KINDS = [
    {"guided_json": {"type": "object", "properties": {"a": {"type": "strng"}}}},
    {"guided_json": {"type": "string", "format": "no-such-format"}},
    {"guided_json": {"type": "object", "description": "x" * 1_000_000}},
    {"guided_json": "slow"},
]  # fmt: skip
"""The acceptance's bad constraints, one each: a bad schema, an unsupported keyword, a
huge schema, and one whose compile outlasts the abuse server's limit (``slow``: a fresh
:func:`slow_schema` per round against ``grammar_compile_timeout_s`` 0.1): each a 400
naming the problem."""
ABUSE_COMPILE_LIMIT_S = 0.1


def burst(url: str, go: multiprocessing.synchronize.Event, done: multiprocessing.Value) -> None:
    """On ``go``, one request of each of :data:`KINDS` at once; ``done`` counts the
    refused ones (400s). Bodies are encoded and
    connections opened before ``go``, so this process costs the machine next to nothing
    while the measured request runs (the server's cost is what is measured)."""
    import http.client
    import threading
    from urllib.parse import urlsplit

    where = urlsplit(url)
    ask = [{"role": "user", "content": "Name a fruit."}]
    tag = f"k{os.getpid()}x"
    kinds = [
        {"guided_json": slow_schema(tag)} if k == {"guided_json": "slow"} else k for k in KINDS
    ]
    bodies = [
        json.dumps({"model": NAME, "messages": ask, "max_tokens": 4, **extra}).encode()
        for extra in kinds
    ]
    connections = []
    for _ in bodies:
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        connection.connect()
        connections.append(connection)

    def send(connection: http.client.HTTPConnection, body: bytes) -> None:
        connection.request(
            "POST", "/v1/chat/completions", body, {"content-type": "application/json"}
        )
        reply = connection.getresponse()
        reply.read()
        if reply.status == 400:
            with done.get_lock():
                done.value += 1

    pairs = zip(connections, bodies, strict=True)
    threads = [threading.Thread(target=send, args=pair) for pair in pairs]
    go.wait()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def flood(
    url: str, stop: multiprocessing.synchronize.Event, refused: multiprocessing.Value
) -> None:
    """A process sending :data:`BAD` requests one after another until ``stop``."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Name a fruit."}]
    while not stop.is_set():
        for extra in BAD:
            try:
                client.chat.completions.create(
                    model=NAME, messages=ask, max_tokens=4, extra_body=extra
                )
            except openai.BadRequestError:
                with refused.get_lock():
                    refused.value += 1


def abuse(url: str, rounds: int, flooders: int, mode: str) -> dict:
    """Plain TTFT alone and with bad requests in flight (``mode`` burst or flood),
    interleaved; the bad ones come from other processes, so the measuring client is
    not slowed."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Name a fruit."}]

    def ttft() -> float:
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=NAME, messages=ask, max_tokens=4, temperature=0, stream=True
        )
        elapsed = 0.0
        for chunk in stream:
            if not elapsed and chunk.choices and chunk.choices[0].delta.content:
                elapsed = time.perf_counter() - start
        return elapsed

    alone: list[float] = []
    flooded: list[float] = []
    refused = multiprocessing.Value("i", 0)
    for _ in range(rounds):
        alone.append(ttft())
        if mode == "burst":
            go = multiprocessing.Event()
            proc = multiprocessing.Process(target=burst, args=(url, go, refused))
            proc.start()
            time.sleep(1.0)  # the process is up, its client made
            go.set()
            time.sleep(0.02)  # the four are on their way
            flooded.append(ttft())
            proc.join()
            continue
        stop = multiprocessing.Event()
        procs = [multiprocessing.Process(target=flood, args=(url, stop, refused))
                 for _ in range(flooders)]  # fmt: skip
        for proc in procs:
            proc.start()
        time.sleep(1.0)
        flooded.append(ttft())
        stop.set()
        for proc in procs:
            proc.join()
    a, f = statistics.median(alone), statistics.median(flooded)
    return {"mode": mode, "alone_s": round(a, 3), "with_bad_s": round(f, 3),
            "ratio": round(f / a, 2), "bad_requests_refused": refused.value,
            "flooders": flooders if mode == "flood" else 0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--abuse-rounds", type=int, default=0)
    parser.add_argument("--abuse", choices=["burst", "flood"], default="burst")
    parser.add_argument("--flooders", type=int, default=2, help="flood: clients sending bad ones")
    args = parser.parse_args()
    family = schemas(seed=args.seed, count=args.requests)
    flags = ("--max-num-seqs", "64")
    result: dict = {"counts": {"invalid": 0, "failed": 0}}
    if family:
        with running_http_serve(Path(NAME), *flags, timeout_s=300) as (_, url, _):
            result = asyncio.run(run(url, family, args.concurrency, args.max_tokens))
    if args.abuse_rounds:
        limit = ("--grammar-compile-timeout-s", str(ABUSE_COMPILE_LIMIT_S))
        with running_http_serve(Path(NAME), *flags, *limit, timeout_s=300) as (_, url, _):
            result["ttft"] = abuse(url, args.abuse_rounds, args.flooders, args.abuse)
    print(json.dumps(result, indent=1))
    counts = result["counts"]
    sys.exit(1 if counts["invalid"] or counts["failed"] else 0)


if __name__ == "__main__":
    main()
