"""End to end: a client notices a scheduler that died (SIGKILL) and fails its waiting
calls with ServerUnavailableError instead of waiting forever."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from support.serve import children_in_role

from ipc.client import AsyncClient
from ipc.errors import ServerUnavailableError
from scheduler_svc.launch import running_server

SERVER_TIMEOUT_S = 2.0
GUARD_S = 30.0
"""What the test waits at most: a client that never notices fails it instead of hanging."""


def _kill_scheduler(serve_pid: int) -> None:
    schedulers = children_in_role(serve_pid, "scheduler")
    assert len(schedulers) == 1, f"scheduler processes under serve: {schedulers}"
    os.kill(schedulers[0], signal.SIGKILL)


def test_client_notices_a_killed_scheduler(model: Path) -> None:
    with running_server(model, "--num-gpu-blocks", "128") as (address, proc):

        async def scenario() -> ServerUnavailableError:
            async with AsyncClient(
                address, timeout=None, ping_interval=0.2, server_timeout_s=SERVER_TIMEOUT_S
            ) as client:
                stream = client.stream(
                    prompt_token_ids=[1, 17, 42, 99], max_tokens=500, ignore_eos=True
                )
                async with asyncio.timeout(GUARD_S):
                    await anext(stream)  # the request runs
                    _kill_scheduler(proc.pid)
                    with pytest.raises(ServerUnavailableError) as caught:
                        async for _ in stream:
                            pass
                    with pytest.raises(ServerUnavailableError):  # still gone: the same again
                        await client.health(timeout=None)
                return caught.value

        error = asyncio.run(scenario())
    assert error.address == address
    assert error.silent_s >= SERVER_TIMEOUT_S
    assert address in str(error)
