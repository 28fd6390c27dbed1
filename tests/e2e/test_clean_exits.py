"""Clean ends (issue 29, item 15): serve exits 0 after a drain that a SIGTERM started
while its worker was still starting; an in-process engine dropped without close()
releases its swap segment itself."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support.blocking import until
from support.limits import SERVE_SAFETY_S
from support.serve import children_in_role

from ipc.client import AsyncClient


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("qwen2")


def test_sigterm_while_the_worker_starts_drains_and_exits_0(qwen2: Path, tmp_path: Path) -> None:
    """The worker is held (SIGSTOP) before it says hello, so requests wait in the
    scheduler's backlog and serve is not ready yet; SIGTERM, then the worker goes on:
    every request finishes in the drain, and serve's status is 0."""
    frontend = f"ipc://{tmp_path}/fe.sock"
    serve = subprocess.Popen(
        [sys.executable, "-m", "expeditor", "serve", "--model", str(qwen2)]
        + ["--frontend", frontend, "--max-num-seqs", "4", "--num-gpu-blocks", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        worker = until(
            lambda: next(iter(children_in_role(serve.pid, "worker")), None),
            "a worker process",
        )
        os.kill(worker, signal.SIGSTOP)
        until(lambda: os.path.exists(f"{tmp_path}/fe.sock"), "the scheduler's socket")

        async def scenario() -> list[int]:
            async with AsyncClient(frontend, timeout=SERVE_SAFETY_S) as client:
                tasks = [
                    asyncio.ensure_future(
                        client.generate(prompt_token_ids=[1, 5 + i], max_tokens=40, ignore_eos=True)
                    )
                    for i in range(12)
                ]
                await asyncio.sleep(0.5)  # they reach the backlog
                serve.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                os.kill(worker, signal.SIGCONT)
                return [len(r.token_ids) for r in await asyncio.gather(*tasks)]

        lengths = asyncio.run(scenario())
        status = serve.wait(timeout=SERVE_SAFETY_S)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    out = serve.stdout.read()  # type: ignore[union-attr]
    err = serve.stderr.read().decode()  # type: ignore[union-attr]
    assert lengths == [40] * 12
    assert out == b"", "serve became ready before the stop: the test did not test it"
    assert status == 0, err[-3000:]


def _segment_exists(name: str) -> bool:
    return Path("/dev/shm", name.lstrip("/")).exists()


def test_an_engine_dropped_without_close_releases_its_swap_segment(qwen2: Path) -> None:
    from expeditor.llm import LLM

    llm = LLM(qwen2, device="cpu", num_gpu_blocks=32, num_cpu_blocks=8)
    assert llm.swap_pool is not None
    name = llm.swap_pool.name
    assert _segment_exists(name)
    del llm
    gc.collect()
    assert not _segment_exists(name)


def test_a_process_that_never_closes_its_engine_leaves_no_segment(qwen2: Path) -> None:
    script = (
        "import sys; from expeditor.llm import LLM; "
        "llm = LLM(sys.argv[1], device='cpu', num_gpu_blocks=32, num_cpu_blocks=8); "
        "print(llm.swap_pool.name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(qwen2)],
        capture_output=True,
        text=True,
        timeout=SERVE_SAFETY_S,
        check=True,
    )
    name = done.stdout.strip().splitlines()[-1]
    assert not _segment_exists(name)
    assert "resource_tracker" not in done.stderr, done.stderr
