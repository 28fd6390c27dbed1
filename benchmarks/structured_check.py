"""Structured output at volume through ``expeditor serve --http`` on the real SmolLM2
checkpoint, with the official openai client: ``--requests`` chat requests, each with a
JSON schema drawn from the seeded family (tests/support/schemas.py: objects, nested
objects, arrays with item bounds, enums, bounded numbers, required fields,
``additionalProperties: false``), half greedy and half at temperature 1 (seeded), sent
``--concurrency`` at a time. Every completion that finished with ``stop`` must parse and
validate against its schema (``jsonschema``); one that finished with ``length`` must
have used all its ``max_tokens``. Prints the counts (and exits 1 on any failure).

    .venv/bin/python benchmarks/structured_check.py [--requests 200] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    family = schemas(seed=args.seed, count=args.requests)
    with running_http_serve(Path(NAME), "--max-num-seqs", "64", timeout_s=300) as (_, url, _):
        result = asyncio.run(run(url, family, args.concurrency, args.max_tokens))
    print(json.dumps(result, indent=1))
    counts = result["counts"]
    sys.exit(1 if counts["invalid"] or counts["failed"] else 0)


if __name__ == "__main__":
    main()
