"""The frontend alone, on an in-process socket: a long prompt is tokenized off the event
loop, so other clients are answered while it runs, and an abort during it holds."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ipc.schema import (
    Abort,
    AbortAck,
    Accepted,
    ClientMessage,
    Generate,
    Ping,
    Pong,
    ServerMessage,
    encode,
    server_decoder,
)
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.frontend import Frontend
from scheduler_svc.outputs import RequestEnded
from scheduler_svc.workers import WorkerRegistry
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams
from shared.server_config import ServerConfig
from shared.tokenizer import INLINE_TOKENIZE_CHARS

LONG_PROMPT = "x" * (INLINE_TOKENIZE_CHARS + 1)


@dataclass
class _Encoding:
    ids: list[int]


class GatedTokenizer:
    """Tokenizes long texts only once the test opens the gate (short ones at once)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        assert len(text) <= INLINE_TOKENIZE_CHARS, "long texts go through encode_batch"
        return _Encoding([1, *([5] * 8)])

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[_Encoding]:
        """What the frontend uses for long texts (it releases the GIL, encode does not)."""
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return [_Encoding([1, *([5] * 8)]) for _ in texts]


@dataclass
class Bench:
    frontend: Frontend
    client: zmq.asyncio.Socket
    tokenizer: GatedTokenizer
    events: asyncio.Queue[StepOutput | RequestEnded]

    async def send(self, message: ClientMessage) -> None:
        await self.client.send(encode(message))

    async def reply(self) -> ServerMessage:
        return server_decoder.decode(await asyncio.wait_for(self.client.recv(), timeout=5))


@contextlib.asynccontextmanager
async def running_frontend() -> AsyncIterator[Bench]:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://frontend")
    client = ctx.socket(zmq.DEALER)
    client.connect("inproc://frontend")
    config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64)
    events: asyncio.Queue[StepOutput | RequestEnded] = asyncio.Queue()
    frontend = Frontend(
        router,
        ServerConfig(),
        config,
        WorkerRegistry(1, 5.0),
        events,
        asyncio.Event(),
        lambda seq_id: None,
    )
    tokenizer = GatedTokenizer()
    core = Scheduler(config, eos_token_ids=[2], kv_bytes_per_block=1)
    frontend.attach(core, "model", tokenizer)  # type: ignore[arg-type]
    task = asyncio.create_task(frontend.run())
    try:
        yield Bench(frontend, client, tokenizer, events)
    finally:
        tokenizer.gate.set()
        task.cancel()
        await asyncio.gather(task, *frontend.tokenizing, return_exceptions=True)
        client.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_other_clients_are_served_while_a_long_prompt_is_tokenized() -> None:
    asyncio.run(_served_while_tokenizing())


async def _served_while_tokenizing() -> None:
    async with running_frontend() as bench:
        await bench.send(Generate(request_id="long", prompt=LONG_PROMPT))
        assert await asyncio.to_thread(bench.tokenizer.entered.wait, 5)
        await bench.send(Ping())
        assert isinstance(await bench.reply(), Pong)  # the loop is not stuck in the tokenizer
        short = Generate(request_id="short", prompt_token_ids=[1, 7], sampling=SamplingParams())
        await bench.send(short)
        accepted = await bench.reply()
        assert isinstance(accepted, Accepted) and accepted.request_id == "short"
        assert bench.frontend.core is not None and "long" not in bench.frontend.core.requests
        bench.tokenizer.gate.set()
        accepted = await bench.reply()
        assert isinstance(accepted, Accepted) and accepted.request_id == "long"
        assert accepted.prompt_token_ids == [1, *([5] * 8)]
        assert "long" in bench.frontend.core.requests


def test_a_request_aborted_while_it_is_tokenized_never_reaches_the_core() -> None:
    asyncio.run(_aborted_while_tokenizing())


async def _aborted_while_tokenizing() -> None:
    async with running_frontend() as bench:
        await bench.send(Generate(request_id="long", prompt=LONG_PROMPT))
        assert await asyncio.to_thread(bench.tokenizer.entered.wait, 5)
        await bench.send(Abort(request_id="long"))
        ack = await bench.reply()
        assert isinstance(ack, AbortAck) and ack.aborted
        assert await bench.events.get() == RequestEnded("long")
        bench.tokenizer.gate.set()
        while bench.frontend.tokenizing:
            await asyncio.sleep(0.01)
        assert bench.frontend.core is not None and "long" not in bench.frontend.core.requests
        await bench.send(Ping())
        assert isinstance(await bench.reply(), Pong)  # no Accepted came before it
