"""A shared-prefix workload through an OpenAI-compatible router (benchmarks/routers.sh).

Many tenants, each with a long system prompt of its own; every request is one
tenant's system prompt plus a short question of its own, as text (routers route on
text: vllm-router tokenizes it through the workers' /v1/completions/render, smg keeps
a radix tree of the characters). Before and after, each replica's /metrics gives the
prefix cache's looked-up and hit prompt tokens and the tokens it generated; the result
(one JSON line) is the hit rate over all replicas, output tokens/s seen by the client,
latencies (time to the first text too, when streamed: the default), each replica's
share, and every failed request with its status and reason.

With ``--kill-pgid PGID --kill-after K`` the process group PGID (one replica) is
SIGKILLed once K requests have finished: the report then says how many of the rest
failed, with what, and whether any waited longer than ``--hang-s`` (a hang).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time

import aiohttp

WORDS = (
    "policy ledger tenant answer brief cite handbook section refund invoice audit "
    "quarterly region vendor shipment contract clause renewal escalation owner budget "
    "forecast variance approval signature archive retention privacy consent request "
    "ticket priority severity outage incident review summary action item deadline"
).split()


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def _scrape(text: str) -> dict[str, float]:
    """The expeditor: counters this benchmark reads, from one replica's /metrics."""
    wanted = {
        "expeditor:prefix_cache_queries_total": "queries",
        "expeditor:prefix_cache_hits_total": "hits",
        "expeditor:generation_tokens_total": "generated",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{", 1)[0]
        if name in wanted:
            found[wanted[name]] += float(value.rsplit(" ", 1)[-1])
    return found


async def _metrics(session: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, float]]:
    out = []
    for url in urls:
        try:
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(10)) as r:
                out.append(_scrape(await r.text()))
        except (TimeoutError, aiohttp.ClientError):
            out.append({})  # a replica that is gone (the kill phase)
    return out


async def _read_stream(reply: aiohttp.ClientResponse, start: float) -> dict[str, object]:
    """Read one streamed completion: its tokens (the final usage chunk) and the time to
    its first text; a stream that ends without usage or ``[DONE]`` is a failure."""
    tokens = None
    ttft = None
    finished = False
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            finished = True
            break
        chunk = json.loads(data)
        if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
            ttft = time.monotonic() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    if not finished or tokens is None:
        return {"status": "truncated", "reason": "the stream ended without usage and [DONE]"}
    return {"tokens": tokens, "ttft_s": ttft}


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    systems = [
        f"Tenant {t} ({args.seed}). " + _text(rng, args.prefix_chars) for t in range(args.tenants)
    ]
    prompts = [
        systems[rng.randrange(args.tenants)] + f"\nQuestion {i}: " + _text(rng, 24) + "?"
        for i in range(args.requests)
    ]
    replicas = args.replicas.split(",")
    limit = asyncio.Semaphore(args.concurrency)
    results: list[dict[str, object]] = []
    done = 0
    killed_at: float | None = None
    async with aiohttp.ClientSession() as session:
        before = await _metrics(session, replicas)

        async def one(prompt: str) -> None:
            nonlocal done, killed_at
            async with limit:
                start = time.monotonic()
                body = {
                    "model": args.model,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                if args.stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                entry: dict[str, object] = {}
                try:
                    async with session.post(
                        args.url + "/v1/completions",
                        json=body,
                        timeout=aiohttp.ClientTimeout(total=args.hang_s),
                    ) as reply:
                        entry["status"] = reply.status
                        if reply.status != 200:
                            payload = await reply.read()
                            entry["reason"] = payload.decode(errors="replace")[:200]
                        elif args.stream:
                            entry.update(await _read_stream(reply, start))
                        else:
                            payload = await reply.read()
                            entry["tokens"] = json.loads(payload)["usage"]["completion_tokens"]
                except TimeoutError:
                    entry.update(status="hung", reason=f"no answer within {args.hang_s} s")
                except aiohttp.ClientError as exc:
                    entry.update(status="connection", reason=repr(exc)[:200])
                entry["latency_s"] = time.monotonic() - start
                entry["after_kill"] = killed_at is not None and start >= killed_at
                results.append(entry)
                done += 1
                if args.kill_pgid and done == args.kill_after and killed_at is None:
                    os.killpg(args.kill_pgid, signal.SIGKILL)
                    killed_at = time.monotonic()

        start = time.monotonic()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.monotonic() - start
        after = await _metrics(session, replicas)
    ok = [r for r in results if r["status"] == 200]
    live = [(b, a) for b, a in zip(before, after, strict=True) if a]
    queries = sum(a["queries"] - b["queries"] for b, a in live)
    hits = sum(a["hits"] - b["hits"] for b, a in live)
    tokens = sum(int(r["tokens"]) for r in ok)  # type: ignore[call-overload]
    latencies = sorted(float(r["latency_s"]) for r in results)  # type: ignore[arg-type]
    ttfts = sorted(float(r["ttft_s"]) for r in ok if r.get("ttft_s") is not None)  # type: ignore[arg-type]
    report: dict[str, object] = {
        "label": args.label,
        "requests": len(results),
        "ok": len(ok),
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
        "hit_rate": round(hits / queries, 3) if queries else None,
        "latency_median_s": round(statistics.median(latencies), 3),
        "latency_max_s": round(latencies[-1], 3),
        "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3) if ttfts else None,
        "share": [
            round(a["generated"] - b["generated"]) if a else None
            for b, a in zip(before, after, strict=True)
        ],
        "failures": [r for r in results if r["status"] != 200],
    }
    if args.kill_pgid:
        report["after_kill_ok"] = sum(1 for r in ok if r["after_kill"])
        report["hung"] = sum(1 for r in results if r["status"] == "hung")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the router's base URL")
    parser.add_argument("--replicas", required=True, help="the replicas' URLs, comma-separated")
    parser.add_argument("--model", required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--tenants", type=int, default=14)
    parser.add_argument("--prefix-chars", type=int, default=1800)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hang-s", type=float, default=60.0)
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the completions (as chat clients do; a router then sees the first "
        "token, which is when vllm-router's kv_aware stops counting a request's prefill)",
    )
    parser.add_argument("--kill-pgid", type=int, default=0)
    parser.add_argument("--kill-after", type=int, default=0)
    print(json.dumps(asyncio.run(run(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
