"""The systems ``expeditor bench`` measures, all on the same checkpoint.

- ``expeditor``: the daemons (``expeditor serve``) through the async client library,
  streaming, so every token's arrival time is seen as a client sees it;
- ``inprocess``: the in-process engine (scheduler core + model runner, no sockets);
- ``static``: naive serving, transformers ``generate`` on left-padded batches of at
  most ``max_num_seqs`` requests in arrival order; each batch runs until its longest
  request ends and returns as a whole (token times are the decode steps' times, the
  finish time is the batch's end);
- ``hf-cb``: transformers' own continuous batching (``init_continuous_batching``
  manager, paged attention), where the installed transformers has it;
- ``openai:URL``: any OpenAI-compatible HTTP server that is already running
  (``expeditor serve --http``, vLLM, SGLang, ``transformers serve``), streaming over
  HTTP; options ``openai:URL[api=chat,model=...,api_key=...,max_concurrency=N]``
  (:mod:`expeditor.bench.openai_target`).

Every target reports per-request timelines on the ``time.perf_counter`` clock.
torch and transformers are imported inside the functions: the scheduler process never
loads them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from expeditor.bench.metrics import KVSample, RequestTimeline
from expeditor.bench.workloads import BenchRequest, Workload
from ipc.schema import PrefixCacheStats, SchedulerSnapshot, SeqStatus, StepTimes
from shared.structured_output import StructuredOutput

TARGETS = ("expeditor", "inprocess", "static", "hf-cb")
"""The targets named by a bare name; ``openai:URL`` is the one with an address."""
OPENAI = "openai"

OnDone = Callable[[], None]


class TargetError(RuntimeError):
    """A target could not be run at all (e.g. every request to a server failed)."""


@dataclass
class TargetRun:
    timelines: list[RequestTimeline]
    kv_samples: list[KVSample] | None = None
    preemptions: dict[str, int] | None = None
    prefix_hit_rate: float | None = None
    step_times: StepTimes | None = None
    """Mean times per step over the whole run (the targets with a step engine)."""
    notes: list[str] = field(default_factory=list)


def _structured(req: BenchRequest) -> StructuredOutput | None:
    if req.structured_outputs is None:
        return None
    return StructuredOutput(**req.structured_outputs)  # type: ignore[arg-type]


def refuse_constraints(workload: Workload, target: str) -> None:
    """A target that cannot constrain outputs refuses a workload with constraints."""
    if workload.constrained:
        raise TargetError(
            f"{target} cannot constrain outputs (the {workload.name} workload's requests "
            "carry structured_outputs); give it constraints=off"
        )


def _flags(config: dict[str, Any]) -> list[str]:
    flags = []
    for key, value in config.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag}={value}")
    return flags


# -- expeditor: the daemons ----------------------------------------------------------------


def run_expeditor(
    workload: Workload, model: Path, config: dict[str, Any], device: str, on_done: OnDone
) -> TargetRun:
    from scheduler_svc.launch import running_server

    config = dict(config)
    serve = config.pop("serve", {})  # [server] settings: expeditor[tensor_parallel_size=2]
    flags = [*_flags(config), *_flags(serve), f"--device={device}"]
    with running_server(model, *flags) as (address, _):
        return asyncio.run(_drive_server(address, workload, on_done))


async def _drive_server(address: str, workload: Workload, on_done: OnDone) -> TargetRun:
    from ipc.client import AsyncClient

    timelines: list[RequestTimeline] = []
    samples: list[KVSample] = []
    async with AsyncClient(address, timeout=3600) as client:
        block_size = int((await client.inspect()).config["block_size"])  # type: ignore[call-overload]
        start = time.perf_counter()

        async def one(req: BenchRequest) -> None:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            arrival = time.perf_counter()
            times: list[float] = []
            stream = client.stream(
                prompt_token_ids=req.prompt_token_ids,
                max_tokens=req.max_tokens,
                temperature=0.0,
                ignore_eos=req.ignore_eos,
                request_id=req.request_id,
                structured_outputs=_structured(req),
            )
            async for delta in stream:
                now = time.perf_counter()
                times.extend([now] * len(delta.token_ids))
            timelines.append(
                RequestTimeline(
                    request_id=req.request_id,
                    arrival_s=arrival,
                    token_times_s=times,
                    finish_s=time.perf_counter(),
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_output_tokens=len(times),
                )
            )
            on_done()

        async def sample_kv() -> None:
            while True:
                reply = await client.inspect()
                if reply.snapshot is not None:
                    samples.append(_kv_from_snapshot(reply.snapshot, block_size))
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample_kv())
        await asyncio.gather(*(one(r) for r in workload.requests))
        sampler.cancel()
        reply = await client.inspect()
        metrics = await client.metrics()
    final = reply.snapshot
    steps = reply.step_times_total.steps if reply.step_times_total else 0
    return TargetRun(
        timelines=timelines,
        kv_samples=samples,
        preemptions=dict(final.preemptions) if final else None,
        prefix_hit_rate=final.prefix_cache.hit_rate if final else None,
        step_times=reply.step_times_total,
        notes=speculation_notes(
            metrics.spec_decode_num_drafts,
            metrics.spec_decode_num_draft_tokens,
            metrics.spec_decode_num_accepted_tokens,
            steps,
        )
        + (prefix_cache_notes(final.prefix_cache) if final else []),
    )


def prefix_cache_notes(stats: PrefixCacheStats) -> list[str]:
    """The prefix cache's tiers in a line (none when nothing was looked up)."""
    if not stats.queried_tokens:
        return []
    host = f", {stats.host_hit_tokens} from the host tier" if stats.host_blocks else ""
    return [
        f"prefix cache: {stats.hit_tokens} of {stats.queried_tokens} prompt tokens hit"
        f"{host}; {stats.queried_tokens - stats.hit_tokens} computed"
    ]


def speculation_notes(drafts: int, draft_tokens: int, accepted: int, steps: int) -> list[str]:
    """The run's speculative decoding, in a line (none when nothing was proposed)."""
    if not drafts:
        return []
    per_step = f", {drafts / steps:.1f} proposals per step" if steps else ""
    return [
        f"speculation: {drafts} proposals of {draft_tokens / drafts:.2f} tokens{per_step}, "
        f"{accepted / draft_tokens:.0%} of their tokens accepted "
        f"(mean accepted length {accepted / drafts:.2f})"
    ]


def _waste_sample(used: int, total: int, tables: list[tuple[int, int]], bs: int) -> KVSample:
    """KV usage now; ``tables`` holds (blocks, tokens) per running sequence. A slot is
    filled when it holds (or the step in flight writes) one of the sequence's tokens."""
    return KVSample(
        time_s=time.perf_counter(),
        used_blocks=used,
        total_blocks=total,
        allocated_slots=sum(blocks * bs for blocks, _ in tables),
        filled_slots=sum(min(blocks * bs, tokens) for blocks, tokens in tables),
    )


def _kv_from_snapshot(snapshot: SchedulerSnapshot, block_size: int) -> KVSample:
    return _waste_sample(
        snapshot.gpu_blocks.total - snapshot.gpu_blocks.free,
        snapshot.gpu_blocks.total,
        [
            (s.num_gpu_blocks, s.num_prompt_tokens + s.num_output_tokens)
            for s in snapshot.seqs
            if s.state is SeqStatus.RUNNING
        ],
        block_size,
    )


# -- inprocess: the engine -----------------------------------------------------------------


def run_inprocess(
    workload: Workload, model: Path, config: dict[str, Any], device: str, on_done: OnDone
) -> TargetRun:
    from expeditor.llm import LLM
    from scheduler_svc.core.introspection import snapshot
    from shared.sampling import SamplingParams

    with LLM(model, device=device, **config) as llm:
        sched = llm.scheduler
        pending = sorted(workload.requests, key=lambda r: r.arrival_s, reverse=True)
        arrivals: dict[str, float] = {}
        token_times: dict[str, list[float]] = {}
        timelines: list[RequestTimeline] = []
        samples: list[KVSample] = []
        prompts = {r.request_id: r for r in workload.requests}
        bs = sched.block_size
        start = time.perf_counter()
        while pending or llm.has_work():
            now = time.perf_counter()
            while pending and start + pending[-1].arrival_s <= now:
                req = pending.pop()
                arrivals[req.request_id] = start + req.arrival_s
                token_times[req.request_id] = []
                llm.add_request(
                    req.request_id,
                    req.prompt_token_ids,
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=req.max_tokens,
                        ignore_eos=req.ignore_eos,
                        structured_outputs=_structured(req),
                    ),
                )
            if not llm.has_work():
                time.sleep(max(0.0, min(0.01, start + pending[-1].arrival_s - now)))
                continue
            output = llm.step()
            stamp = time.perf_counter()
            for seq in output.advanced:
                if seq.sample_index == 0:  # the workloads' requests have one sample
                    token_times[seq.request.request_id].append(stamp)
            for rid in output.finished_requests:
                llm.finished.pop(rid, None)
                times = token_times.pop(rid)
                timelines.append(
                    RequestTimeline(
                        request_id=rid,
                        arrival_s=arrivals[rid],
                        token_times_s=times,
                        finish_s=stamp,
                        num_prompt_tokens=len(prompts[rid].prompt_token_ids),
                        num_output_tokens=len(times),
                    )
                )
                on_done()
            samples.append(
                _waste_sample(
                    sched.kv.pool.num_blocks - sched.kv.pool.num_free,
                    sched.kv.pool.num_blocks,
                    [(len(s.block_table), s.num_tokens) for s in sched.running],
                    bs,
                )
            )
        return TargetRun(
            timelines=timelines,
            kv_samples=samples,
            preemptions=dict(sched.preemptions),
            prefix_hit_rate=(sched.kv.hit_tokens / sched.kv.queried_tokens)
            if sched.kv.queried_tokens
            else 0.0,
            step_times=llm.engine.times.total(),
            notes=speculation_notes(
                sched.speculation.num_drafts,
                sched.speculation.num_draft_tokens,
                sched.speculation.num_accepted_tokens,
                sched.step,
            )
            + prefix_cache_notes(snapshot(sched).prefix_cache),
        )


# -- static: padded batches --------------------------------------------------------------


def run_static(
    workload: Workload, model: Path, config: dict[str, Any], device: str, on_done: OnDone
) -> TargetRun:
    refuse_constraints(workload, "static")
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from gpu_worker.dtype import resolve_dtype
    from gpu_worker.model_runner import resolve_device

    dev = resolve_device(device)
    dtype, _ = resolve_dtype(config.get("dtype", "auto"), dev)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(dev)
    hf.eval()
    batch_size = int(config.get("max_num_seqs", 256))

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    requests = sorted(workload.requests, key=lambda r: r.arrival_s)
    timelines: list[RequestTimeline] = []
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        ready_at = start + max(r.arrival_s for r in batch)
        time.sleep(max(0.0, ready_at - time.perf_counter()))
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor(
            [[0] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch],
            device=dev,
        )
        mask = torch.tensor(
            [
                [0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                for r in batch
            ],
            device=dev,
        )
        longest = max(r.max_tokens for r in batch)
        clock = StepClock()
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        end = time.perf_counter()
        for req in batch:
            timelines.append(
                RequestTimeline(
                    request_id=req.request_id,
                    arrival_s=start + req.arrival_s,
                    token_times_s=clock.times[: req.max_tokens],
                    finish_s=end,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_output_tokens=req.max_tokens,
                )
            )
            on_done()
    return TargetRun(
        timelines=timelines,
        notes=[f"batches of {batch_size}, each until its longest request ends"],
    )


# -- hf-cb: transformers' continuous batching --------------------------------------------


def run_hf_cb(
    workload: Workload, model: Path, config: dict[str, Any], device: str, on_done: OnDone
) -> TargetRun:
    refuse_constraints(workload, "hf-cb")
    from transformers import AutoModelForCausalLM, GenerationConfig

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as exc:  # an older transformers
        raise RuntimeError("the installed transformers has no continuous batching") from exc
    from gpu_worker.dtype import resolve_dtype
    from gpu_worker.model_runner import resolve_device

    dev = resolve_device(device)
    hf = AutoModelForCausalLM.from_pretrained(
        model,
        dtype=resolve_dtype(config.get("dtype", "auto"), dev)[0],
        attn_implementation="paged|sdpa",
    ).to(dev)
    hf.eval()
    block_size = int(config.get("block_size", 16))
    num_blocks = config.get("num_gpu_blocks") or 4096
    manager = hf.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=1, eos_token_id=None),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=int(num_blocks),
            page_size=block_size,
            max_batch_tokens=int(config.get("max_num_batched_tokens", 8192)),
            max_requests_per_batch=int(config.get("max_num_seqs", 256)),
        ),
    )
    pending = sorted(workload.requests, key=lambda r: r.arrival_s, reverse=True)
    by_id = {r.request_id: r for r in workload.requests}
    timelines: list[RequestTimeline] = []
    manager.start()
    start = time.perf_counter()
    try:
        while len(timelines) < len(workload.requests):
            now = time.perf_counter()
            while pending and start + pending[-1].arrival_s <= now:
                req = pending.pop()
                manager.add_request(
                    req.prompt_token_ids,
                    request_id=req.request_id,
                    max_new_tokens=req.max_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            result = manager.get_result(timeout=0.05)
            if result is None:
                if pending or manager.is_running():
                    continue
                raise RuntimeError("transformers' continuous batching stopped early")
            if not result.is_finished():
                continue
            req = by_id[result.request_id]
            if result.error:
                raise RuntimeError(f"hf-cb request {req.request_id}: {result.error}")
            times = list(result.timestamps or [])
            timelines.append(
                RequestTimeline(
                    request_id=req.request_id,
                    arrival_s=start + req.arrival_s,
                    token_times_s=times,
                    finish_s=times[-1] if times else time.perf_counter(),
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_output_tokens=len(result.generated_tokens),
                )
            )
            on_done()
    finally:
        manager.stop(block=True)
    return TargetRun(timelines=timelines)


# -- openai:URL: an HTTP server ----------------------------------------------------------


def run_openai(
    workload: Workload, model: Path, config: dict[str, Any], device: str, on_done: OnDone
) -> TargetRun:
    """``config`` holds the target's options (``url``, ``api``, ...), not scheduler settings."""
    from expeditor.bench.openai_target import run_openai as run

    return run(workload, model, config, device, on_done)


RUNNERS: dict[str, Callable[[Workload, Path, dict[str, Any], str, OnDone], TargetRun]] = {
    "expeditor": run_expeditor,
    "inprocess": run_inprocess,
    "static": run_static,
    "hf-cb": run_hf_cb,
    OPENAI: run_openai,
}
