"""The scheduler's real :class:`~scheduler_svc.frontend.Frontend` and core on an
in-process ROUTER, for tests of what clients see (no steps run unless a test plans them
with ``bench.core.schedule()``; text prompts tokenize to fixed ids)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.frontend import Frontend
from scheduler_svc.outputs import RequestEnded
from scheduler_svc.workers import WorkerRegistry
from shared.config import SchedulerConfig
from shared.server_config import ServerConfig


@dataclass
class _Encoding:
    ids: list[int]


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        return _Encoding([1, 5, 5])


@dataclass
class Bench:
    frontend: Frontend
    core: Scheduler
    context: zmq.asyncio.Context
    address: str


@contextlib.asynccontextmanager
async def running_frontend(
    config: SchedulerConfig | None = None,
    server: ServerConfig | None = None,
    *,
    sndhwm: int = 1000,
    address: str = "inproc://frontend-bench",
) -> AsyncIterator[Bench]:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, sndhwm)  # before bind: pipes take it when created
    router.bind(address)
    config = config or SchedulerConfig(num_gpu_blocks=64, max_model_len=64)
    events: asyncio.Queue[StepOutput | RequestEnded] = asyncio.Queue()
    frontend = Frontend(
        router,
        server or ServerConfig(),
        config,
        WorkerRegistry(1, 5.0),
        events,
        asyncio.Event(),
        lambda seq_id: None,
    )
    core = Scheduler(config, eos_token_ids=[2], kv_bytes_per_block=1)
    frontend.attach(core, "model", _Tokenizer())  # type: ignore[arg-type]
    task = asyncio.create_task(frontend.run())
    try:
        yield Bench(frontend, core, context, address)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        frontend.outbox.close()
        router.close(linger=0)
        context.term()
