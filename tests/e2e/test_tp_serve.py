"""Tensor parallelism through `expeditor serve`: two worker ranks in one gloo group,
each holding half of the model's heads and MLP, on CPU; greedy outputs equal
transformers run alone, under chunked prefill, prefix hits, swap and recompute, and
after one rank is killed mid-run (the group restarts as a whole). Both ranks run the
lean forward for the model types it covers (llama, qwen2 here) and transformers'
modules for the others (gemma2), as their logs say."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.hf_reference import Oracle, hf_greedy
from support.serve import children_in_role, generate_all

from ipc.client import AsyncClient, Client
from ipc.errors import ClientTimeoutError, ServerError
from scheduler_svc.launch import free_port, running_server

MAX_TOKENS = 10
SHARED = list(range(40, 72))


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    private = [[1] + [rng.randrange(3, 259) for _ in range(n)] for n in (4, 30, 45, 12)]
    shared = [[1, *SHARED, *[rng.randrange(3, 259) for _ in range(n)]] for n in (3, 9)]
    return private + shared


PROMPTS = _prompts()
TP = ("--tensor-parallel-size", "2", "--device", "cpu")
SCENARIOS = {
    # Prefill in chunks of 16 tokens across 4-token blocks; prompts share a prefix.
    "chunked+prefix": ("--block-size", "4", "--max-num-batched-tokens", "16",
                       "--num-gpu-blocks", "128"),
    # Too few device blocks: sequences are swapped out to the group's pool and back.
    "swap": ("--block-size", "4", "--num-gpu-blocks", "20", "--num-cpu-blocks", "128",
             "--preemption-mode", "swap", "--watermark", "0", "--max-num-batched-tokens", "64"),
    "recompute": ("--block-size", "4", "--num-gpu-blocks", "20", "--preemption-mode",
                  "recompute", "--watermark", "0", "--max-num-batched-tokens", "64"),
}  # fmt: skip


async def _generate_all(address: str) -> list[list[int]]:
    return await generate_all(address, PROMPTS, MAX_TOKENS, timeout=180)


FORWARDS = {
    "llama": "lean (model type 'llama', sharded over 2 ranks)",
    "qwen2": "lean (model type 'qwen2', sharded over 2 ranks)",
    "gemma2": "transformers (model type 'gemma2' (lean: llama, mistral, qwen2, qwen3))",
}
"""The forward each rank logs it runs (``rank R: forward: ...``), by checkpoint."""


def _forwards(proc: subprocess.Popen[bytes]) -> dict[int, str]:
    """Each rank's last ``forward:`` log line so far, from what serve's stderr holds."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    found: dict[int, str] = {}
    for match in re.finditer(r"rank (\d+): forward: (.*)", data.decode(errors="replace")):
        found[int(match.group(1))] = match.group(2).strip()
    return found


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2"])
def checkpoint(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path], hf_oracle: Oracle
):
    """llama; qwen2 (q/k/v biases, a sliding window on its second layer); gemma2 (a
    window on every other layer, attention and final-logit soft-capping)."""
    path = tiny_checkpoint(request.param)
    return path, hf_oracle(path, PROMPTS, MAX_TOKENS), FORWARDS[request.param]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tp2_greedy_equals_transformers(checkpoint, scenario: str) -> None:
    path, expected, forward = checkpoint
    with running_server(path, *TP, *SCENARIOS[scenario]) as (address, proc):
        assert asyncio.run(_generate_all(address)) == expected
        with Client(address) as client:
            reply = client.inspect()
        assert _forwards(proc) == {0: forward, 1: forward}
    ranks = sorted(w.rank for w in reply.workers if w.state == "ready")
    assert ranks == [0, 1]
    assert all(w.group_size == 2 for w in reply.workers)
    snapshot = reply.snapshot
    assert snapshot is not None
    if scenario == "swap":
        assert snapshot.preemptions["swap"] > 0
    if scenario == "recompute":
        assert snapshot.preemptions["recompute"] > 0
    if scenario == "chunked+prefix":
        assert snapshot.prefix_cache.hit_tokens >= 32


def test_killing_one_rank_restarts_the_group_and_loses_nothing(model: Path) -> None:
    path = model
    expected = hf_greedy(path, PROMPTS, 40)
    flags = (*TP, "--num-gpu-blocks", "256", "--worker-timeout-s", "2")
    with running_server(path, *flags) as (address, proc):
        before = children_in_role(proc.pid, "worker")
        assert len(before) == 2

        async def scenario() -> list[list[int]]:
            async with AsyncClient(address, timeout=240) as client:
                tasks = [
                    asyncio.ensure_future(
                        client.generate(prompt_token_ids=p, max_tokens=40, temperature=0.0)
                    )
                    for p in PROMPTS
                ]
                while (await client.inspect()).snapshot.step < 5:
                    await asyncio.sleep(0.02)
                os.kill(before[1], signal.SIGKILL)  # rank 1 (or 0): the group goes down
                results = await asyncio.gather(*tasks)
                return [r.token_ids for r in results]

        outputs = asyncio.run(scenario())
        after = children_in_role(proc.pid, "worker")
        forwards = _forwards(proc)  # the restarted ranks' lines, the last of each rank
    assert outputs == expected
    assert forwards == {0: FORWARDS["llama"], 1: FORWARDS["llama"]}
    assert len(after) == 2 and not set(after) & set(before)  # both ranks are new processes


def test_ranks_started_as_separate_nodes_from_one_config(model: Path, tmp_path: Path) -> None:
    """What two machines would run, on one: the scheduler, then each rank started on its
    own (`expeditor worker --rank R --config FILE`), all from the same config file with a
    tcp:// worker endpoint and a fixed rendezvous; no serve supervising them."""
    path = model
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    ports = [free_port() for _ in range(3)]
    config = tmp_path / "expeditor.toml"
    config.write_text(
        "[server]\n"
        f'model = "{path}"\n'
        f'frontend = "ipc://{tmp_path}/frontend.sock"\n'
        f'worker_endpoint = "tcp://127.0.0.1:{ports[0]}"\n'
        "insecure_tcp = true\n"
        'device = "cpu"\n'
        "tensor_parallel_size = 2\n"
        'dist_master_addr = "127.0.0.1"\n'
        f"dist_master_port = {ports[1]}\n"
        "[scheduler]\n"
        "num_gpu_blocks = 128\n"
    )
    command = [sys.executable, "-m", "expeditor"]
    procs = [subprocess.Popen([*command, "scheduler", "--config", str(config)],
                              stderr=subprocess.DEVNULL)]  # fmt: skip
    try:
        for rank in (1, 0):  # any order: the group forms when both have joined
            with (tmp_path / f"rank{rank}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [*command, "worker", "--rank", str(rank), "--config", str(config)],
                        stderr=log,
                    )
                )
        address = f"ipc://{tmp_path}/frontend.sock"
        with Client(address, timeout=5) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.health().status == "ok":
                        break
                except (ClientTimeoutError, ServerError):
                    pass
                assert time.monotonic() < deadline, "the group never became ready"
                assert all(p.poll() is None for p in procs)
                time.sleep(0.2)
            reply = client.inspect()
        assert sorted(w.rank for w in reply.workers) == [0, 1]
        assert asyncio.run(_generate_all(address)) == expected
        for rank in (0, 1):
            log = (tmp_path / f"rank{rank}.log").read_text()
            assert f"rank {rank}: forward: {FORWARDS['llama']}" in log
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_tp4_where_the_heads_divide(model: Path, tmp_path: Path) -> None:
    """Four ranks on a llama whose 4 KV heads divide by 4 (the presets have 2): each
    rank holds one KV head and two query heads; greedy output still equals
    transformers'."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tiny = model
    config = LlamaConfig.from_pretrained(tiny)
    config.num_attention_heads = 8
    config.num_key_value_heads = 4
    config.head_dim = 8
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():  # unit-scale activations, as the presets have
            if parameter.dim() == 2:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
    path = tmp_path / "kv4"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, path / name)
    expected = hf_greedy(path, PROMPTS[:3], MAX_TOKENS)
    flags = ("--tensor-parallel-size", "4", "--device", "cpu", "--block-size", "8",
             "--max-num-batched-tokens", "32", "--num-gpu-blocks", "64")  # fmt: skip
    with running_server(path, *flags, timeout_s=240) as (address, proc):
        assert asyncio.run(generate_all(address, PROMPTS[:3], MAX_TOKENS, timeout=240)) == expected
        with Client(address) as client:
            assert sorted(w.rank for w in client.inspect().workers) == [0, 1, 2, 3]
        lean = "lean (model type 'llama', sharded over 4 ranks)"
        assert _forwards(proc) == dict.fromkeys(range(4), lean)
