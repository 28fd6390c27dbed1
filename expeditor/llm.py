"""The in-process engine: scheduler core and one model runner, no sockets.

It runs the daemon's step (:class:`~scheduler_svc.step_engine.StepEngine`, with the
runner as an :class:`~scheduler_svc.step_engine.InlineExecutor`) and the daemon's
output path (:class:`~scheduler_svc.outputs.OutputProcessor`: detokenization, stop
strings, logprobs, n>1), so what it returns is what a client of the server gets.

For tests, benchmarks and offline batch jobs::

    from expeditor.llm import LLM
    from shared import SamplingParams

    with LLM(num_gpu_blocks=256, max_num_batched_tokens=64) as llm:
        out = llm.generate(["Hello", [1, 72, 105]], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu_worker.model_runner import ModelRunner, resolve_device
from ipc.schema import ErrorCode, ErrorReply, Finished, ServerMessage
from scheduler_svc.core.request import RejectedError, Request
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.engine_builder import build_engine
from scheduler_svc.outputs import ClientRequest, OutputProcessor
from scheduler_svc.step_engine import InlineExecutor
from scheduler_svc.structured_output import GrammarCompiler
from shared.config import SchedulerConfig
from shared.errors import ConfigError, InvalidRequestError
from shared.outputs import Completion
from shared.sampling import SamplingParams
from shared.server_config import ModelConfig
from shared.swap_pool import SwapPoolSegment
from shared.tokenizer import encode_ids, load_tokenizer
from shared.worker_settings import WorkerSettings

Prompt = str | list[int]

ENGINE_SERVER_FIELDS = (
    "dtype",
    "gpu_memory_utilization",
    "cuda_graphs",
    "model_impl",
    "speculative_model",
    "kv_cache_dtype",
)
"""The ``[server]`` fields ``LLM`` takes as keywords (the others are about daemons,
sockets and tensor-parallel groups, which an in-process engine has none of)."""


def engine_settings(
    model: str | Path | None = None, **config: Any
) -> tuple[SchedulerConfig, WorkerSettings]:
    """The scheduler configuration and the worker settings ``LLM(model, **config)`` runs
    by: ``config`` names fields of :class:`SchedulerConfig` and of
    :data:`ENGINE_SERVER_FIELDS`; every other field keeps its declared default, as it
    does for the daemon."""
    server = {name: config.pop(name) for name in ENGINE_SERVER_FIELDS if name in config}
    try:
        scheduler = SchedulerConfig(**config)
    except TypeError as exc:
        raise ConfigError(f"unknown engine keyword: {exc}") from None
    checkpoint = ModelConfig(model=str(model) if model is not None else "", **server)
    return scheduler, WorkerSettings(server=checkpoint, scheduler=scheduler)


class LLM:
    """``LLM(model=DIR, **config)``; config keywords are SchedulerConfig fields and
    :data:`ENGINE_SERVER_FIELDS` (see :func:`engine_settings`)."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        **config: Any,
    ) -> None:
        """``dtype``: auto | float32 | bfloat16 | float16 (the ``dtype`` setting), or a
        torch dtype."""
        named = {"dtype": dtype} if isinstance(dtype, str) else {}
        scheduler_config, settings = engine_settings(model, **named, **config)
        self.device = resolve_device(device)
        given = None if isinstance(dtype, str) else dtype
        self.runner = ModelRunner(settings, device=self.device, dtype=given)
        self.model_dir = self.runner.model_dir
        self.tokenizer = load_tokenizer(self.model_dir)
        # The daemon's start-up, with this runner's hello: the config sized by it, the
        # swap pool and the engine. The runner is looked up at every step, so a test may
        # wrap runner.execute.
        built = build_engine(
            scheduler_config,
            self.runner.hello(),
            InlineExecutor(lambda plan: self.runner.execute(plan)),
        )
        self.config, self.scheduler, self.engine = built.config, built.core, built.engine
        self.swap_pool: SwapPoolSegment | None = built.swap_pool
        if self.swap_pool is not None:
            self.runner.kv_cache.attach_swap_pool(self.swap_pool)
        # Released by close(), or when this engine is garbage-collected without it (the
        # segment is never left to Python's resource tracker and its exit-time warning).
        self._release = weakref.finalize(self, _release_swap_pool, self.runner, self.swap_pool)
        self.outputs = OutputProcessor(self.tokenizer, self._collect, self.engine.stop_seq)
        self.finished: dict[str, Completion] = {}
        """Completions of requests queued with :meth:`add_request`, until taken."""
        self.failed: dict[str, ErrorReply] = {}
        """Why requests queued with :meth:`add_request` failed while running (no token
        could be drawn, a structured output's matcher failed), until taken."""
        self._next_id = 0
        self._grammars: GrammarCompiler | None = None
        """Built with the first structured-output request (its tokenizer takes ~0.5 s)."""

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return encode_ids(self.tokenizer, prompt)
        return list(prompt)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion; raises RejectedError for one that never fits,
        or whose request failed while running (``bad_request``: no token could be drawn
        for it, or its structured output's matcher failed)."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of prompts, not one string")
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} params for {len(prompts)} prompts")
        request_ids: list[str] = []
        for index, prompt in enumerate(prompts):
            request_id = f"req-{self._next_id}"
            self._next_id += 1
            try:
                self.add_request(
                    request_id,
                    self.encode(prompt),
                    per_prompt[index],
                    priority=priorities[index] if priorities else 0,
                )
            except RejectedError as exc:
                for earlier in request_ids:
                    self.scheduler.abort(earlier)
                    self.outputs.requests.pop(earlier, None)
                raise RejectedError(exc.code, f"prompt {index}: {exc.message}", exc.field) from None
            request_ids.append(request_id)
        while self.has_work():
            self.step()
        failed = [(i, self.failed.pop(r)) for i, r in enumerate(request_ids) if r in self.failed]
        if failed:
            for request_id in request_ids:
                self.finished.pop(request_id, None)
            index, error = failed[0]
            raise RejectedError(error.code, f"prompt {index}: {error.message}", error.field)
        return [self.finished.pop(request_id) for request_id in request_ids]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> Request:
        """Queue one request; drive :meth:`step` until its Completion is in
        :attr:`finished` (pop it from there)."""
        constraint = None
        if params.structured_outputs is not None:
            if self._grammars is None:
                self._grammars = GrammarCompiler.for_scheduler(self.tokenizer, self.scheduler)
            try:
                constraint = self._grammars.compile(params.structured_outputs)
            except InvalidRequestError as exc:
                raise RejectedError(ErrorCode.BAD_REQUEST, str(exc)) from None
        request = self.scheduler.add_request(
            request_id, prompt_token_ids, params, priority=priority, constraint=constraint
        )
        self.outputs.requests[request_id] = ClientRequest(
            request_id=request_id,
            client=b"",
            owner=b"",
            stream=False,
            params=params,
            prompt_token_ids=list(prompt_token_ids),
            arrival=time.monotonic(),
        )
        return request

    def has_work(self) -> bool:
        """Requests to run, or steps planned ahead whose results are not applied yet."""
        return self.engine.has_work()

    def step(self) -> StepOutput:
        """One step (:class:`StepEngine`), its outputs processed as the daemon does:
        detokenized, stop strings applied, finished requests collected."""
        output = self.engine.step()
        started = time.perf_counter()
        self.outputs.on_step(output)
        self.engine.times.add_outputs(time.perf_counter() - started)
        return output

    def _collect(self, client: bytes, message: ServerMessage) -> None:
        if isinstance(message, Finished):
            self.finished[message.request_id] = message.completion
        elif isinstance(message, ErrorReply) and message.request_id is not None:
            self.failed[message.request_id] = message

    def close(self) -> None:
        self._release()
        self.swap_pool = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_swap_pool(runner: ModelRunner, pool: SwapPoolSegment | None) -> None:
    runner.kv_cache.detach_swap_pool()
    if pool is not None:
        pool.close()
