"""Engine start-up, written once: the scheduler core, the swap pool and the step engine
built from the scheduler configuration and what the first worker said about itself.

The daemon calls :func:`build_engine` when the first :class:`~ipc.schema.WorkerHello`
arrives, with the :class:`~scheduler_svc.remote_executor.RemoteExecutor` as executor;
``LLM`` calls it with its model runner's hello and an
:class:`~scheduler_svc.step_engine.InlineExecutor`. Either way the configuration is sized
the same: ``num_gpu_blocks`` is the worker's cache, ``max_model_len`` is capped by the
checkpoint's own limit (:func:`shared.checkpoint.capped_max_len`), and a swap pool of
``num_cpu_blocks`` blocks of the worker's KV block size is created when that is not 0.
Mapping the pool in the workers is the caller's (the daemon sends AttachSwapPool, ``LLM``
attaches it to its runner's cache), as is closing it. Workers that load a draft model
(their hello names it) draft the speculative proposals: the core plans draft lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ipc.schema import WorkerHello
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.step_engine import Executor, StepEngine
from scheduler_svc.step_times import StepTimer
from shared.checkpoint import capped_max_len
from shared.config import SchedulerConfig
from shared.errors import ConfigError
from shared.swap_pool import SwapPoolSegment

__all__ = ["BuiltEngine", "build_engine", "sized_config"]


@dataclass(frozen=True)
class BuiltEngine:
    config: SchedulerConfig
    """The configuration as sized by the worker (the core's own)."""
    core: Scheduler
    engine: StepEngine
    swap_pool: SwapPoolSegment | None
    """The swap pool, when ``num_cpu_blocks`` is not 0 (the caller closes it)."""


def sized_config(config: SchedulerConfig, hello: WorkerHello) -> SchedulerConfig:
    """``config`` with the worker's cache size and the checkpoint's length limit; for a
    cache of layer groups, the CPU pools' blocks as many bytes in blocks of a group's
    layers (``WorkerHello.kv_block_layers``)."""
    layers, per_block = hello.kv_block_layers or (1, 1)
    return msgspec.structs.replace(
        config,
        num_gpu_blocks=hello.num_gpu_blocks,
        num_cpu_blocks=config.num_cpu_blocks * layers // per_block,
        prefix_cache_cpu_blocks=config.prefix_cache_cpu_blocks * layers // per_block,
        max_model_len=capped_max_len(config.max_model_len, hello.model),
    )


def build_engine(
    config: SchedulerConfig,
    hello: WorkerHello,
    executor: Executor,
    *,
    times: StepTimer | None = None,
) -> BuiltEngine:
    """Scheduler, swap pool and step engine for workers like the one that sent ``hello``
    (the first to register), their plans run by ``executor``, each step's parts added to
    ``times``."""
    if hello.draft_model and not config.num_speculative_tokens:
        raise ConfigError(
            f"speculative_model: the workers load a draft model ({hello.draft_model}) but "
            "num_speculative_tokens is 0: set how many tokens it drafts (1-16), or unset "
            "speculative_model",
            field="num_speculative_tokens",
        )
    sized = sized_config(config, hello)
    swap_pool = (
        SwapPoolSegment.create(sized.num_cpu_blocks, hello.kv_bytes_per_block)
        if sized.num_cpu_blocks
        else None
    )
    core = Scheduler(
        sized,
        eos_token_ids=hello.eos_token_ids,
        kv_bytes_per_block=hello.kv_bytes_per_block,
        vocab_size=hello.vocab_size or None,
        drafting=bool(hello.draft_model),
        kv_window=hello.kv_window,
        kv_groups=tuple(hello.kv_groups),
    )
    return BuiltEngine(sized, core, StepEngine(core, executor, times=times), swap_pool)
