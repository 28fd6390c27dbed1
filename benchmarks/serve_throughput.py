"""End-to-end tokens/s of `expeditor serve` (daemons, ZeroMQ, client library) against
the in-process engine, on the same workload and checkpoint, in one run.

Workload: 64 requests at once, prompts 16..128 tokens, 32..64 output tokens
(ignore_eos), greedy; max_num_seqs 64, max_num_batched_tokens 2048; CPU.

    .venv/bin/python benchmarks/serve_throughput.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from expeditor.llm import LLM
from gpu_worker.tiny_model import make_tiny_model
from ipc.client import AsyncClient
from scheduler_svc.launch import running_server
from shared.sampling import SamplingParams

CONFIG = {"num_gpu_blocks": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def workload(count: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [
        ([1] + [rng.randrange(3, 259) for _ in range(rng.randint(16, 128))], rng.randint(32, 64))
        for _ in range(count)
    ]


async def run_served(address: str, requests: list[tuple[list[int], int]]) -> int:
    async with AsyncClient(address, timeout=600) as client:
        results = await asyncio.gather(
            *(
                client.generate(prompt_token_ids=p, max_tokens=m, temperature=0.0, ignore_eos=True)
                for p, m in requests
            )
        )
    return sum(len(r.token_ids) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()
    requests = workload(args.num_requests)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in CONFIG.items()]
        with running_server(model, *flags) as (address, _):
            asyncio.run(run_served(address, requests[:2]))  # warm-up
            started = time.perf_counter()
            served_tokens = asyncio.run(run_served(address, requests))
            served_s = time.perf_counter() - started
        with LLM(model, device="cpu", **CONFIG) as llm:
            params = [
                SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests
            ]
            llm.generate([p for p, _ in requests[:2]], params[:2])
            started = time.perf_counter()
            outputs = llm.generate([p for p, _ in requests], params)
            local_s = time.perf_counter() - started
        local_tokens = sum(len(o.token_ids) for o in outputs)
    report = {
        "requests": len(requests),
        "serve_tokens_per_s": served_tokens / served_s,
        "inprocess_tokens_per_s": local_tokens / local_s,
        "ratio": (served_tokens / served_s) / (local_tokens / local_s),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
