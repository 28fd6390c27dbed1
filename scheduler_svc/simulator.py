"""Trace-driven simulation: the real scheduler core stepping a fake worker.

A trace is JSON Lines, one request per line::

    {"id": "r1", "arrival_step": 0, "prompt_len": 100, "max_tokens": 32,
     "priority": 0, "n": 1, "eos_at": 5, "abort_step": 40, "client": "a"}

``prompt_token_ids`` may replace ``prompt_len`` (for shared prefixes); ``priority``
(lower runs first), ``n``, ``eos_at`` (the k-th output token, 1-based, is EOS),
``abort_step`` (the client aborts before that step) and ``client`` (who submits it,
for fair share; absent = one anonymous client) are optional.

The simulation is step-exact by default: each step's result is applied before the next
plan (``overlap_scheduling`` off), so a step record shows one decision and its outcome.
``overlap=True`` plans ahead as the daemon does (the tests check that outputs stay the
same); a record then describes the step whose result was just applied (its plan, its
planning's decisions and its output), while the queue sizes are those after it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from scheduler_svc.core.request import RejectedError
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.fake_worker import FakeModel, FakeProposer, FakeWorker
from scheduler_svc.step_engine import InlineExecutor, StepEngine
from shared.config import SchedulerConfig
from shared.outputs import FinishReason
from shared.sampling import SamplingParams
from shared.stats import percentile, summarize

DEFAULT_KV_BYTES_PER_BLOCK = 2 * 1024 * 1024
"""A 16-token block of an 8B GQA model (32 layers, 8 KV heads of 128, bf16)."""


class TraceError(ValueError):
    """A trace line that is not a valid request."""


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: str
    arrival_step: int = 0
    prompt_len: int | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16
    priority: int = 0
    n: int = 1
    eos_at: int | None = None
    abort_step: int | None = None
    client: str | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, n=self.n, temperature=0.0)


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            req = msgspec.json.decode(line, type=TraceRequest)
        except msgspec.DecodeError as exc:
            raise TraceError(f"{where}: {exc}") from None
        if (req.prompt_len is None) == (req.prompt_token_ids is None):
            raise TraceError(f"{where}: give exactly one of prompt_len and prompt_token_ids")
        if req.prompt_len is not None and req.prompt_len < 1:
            raise TraceError(f"{where}: prompt_len must be >= 1")
        if req.arrival_step < 0 or (req.abort_step is not None and req.abort_step < 0):
            raise TraceError(f"{where}: steps must be >= 0")
        if req.eos_at is not None and req.eos_at < 1:
            raise TraceError(f"{where}: eos_at is 1-based and must be >= 1")
        if req.id in seen:
            raise TraceError(f"{where}: duplicate id {req.id!r}")
        seen.add(req.id)
        requests.append(req)
    return requests


def load_trace(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    return parse_trace(text.splitlines(), str(path))


@dataclass
class SimResult:
    summary: dict[str, Any]
    outputs: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """request id -> sequence id -> output tokens (finished or aborted requests)."""
    finish_reasons: dict[str, str] = field(default_factory=dict)
    """request id -> reason its last sequence ended with."""
    seq_finish_reasons: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


class Simulation:
    """Runs one trace; :meth:`run` returns the summary and every output."""

    def __init__(
        self,
        trace: list[TraceRequest],
        config: SchedulerConfig,
        *,
        kv_bytes_per_block: int = DEFAULT_KV_BYTES_PER_BLOCK,
        verify_kv: bool = False,
        check_invariants: bool = True,
        max_steps: int | None = None,
        overlap: bool = False,
        proposal_acceptance: float | None = None,
        drafted: bool = False,
        kv_window: int = 0,
        kv_groups: tuple[int, ...] = (),
    ) -> None:
        """``proposal_acceptance``: with ``num_speculative_tokens``, decodes propose
        through :class:`~scheduler_svc.fake_worker.FakeProposer`, whose tokens are the
        fake model's with this probability (None: prompt lookup, as served).
        ``drafted``: the fake worker drafts those tokens, as a draft model does (plans
        carry ``draft_lengths``), instead of the scheduler proposing them.
        ``kv_window``: the model's layers all read a sliding window of that many keys
        (as a worker's hello says), so the scheduler releases blocks behind it;
        ``kv_groups``: the cache holds layer groups with these windows (0: full
        attention), a table their blocks side by side (``scheduler_svc.core.kv_groups``)."""
        if drafted and proposal_acceptance is None:
            raise ValueError("drafted proposals need a proposal_acceptance")
        if config.num_gpu_blocks is None:
            raise ValueError("simulation needs num_gpu_blocks")
        self.trace = sorted(trace, key=lambda r: r.arrival_step)
        config = msgspec.structs.replace(config, overlap_scheduling=overlap)
        self.config = config
        self.model = FakeModel(eos_at={r.id: r.eos_at for r in trace if r.eos_at is not None})
        proposer = (
            None if proposal_acceptance is None else FakeProposer(self.model, proposal_acceptance)
        )
        self.scheduler = Scheduler(
            config,
            eos_token_ids=[self.model.eos_token_id],
            kv_bytes_per_block=kv_bytes_per_block,
            proposer=proposer,
            drafting=drafted,
            kv_window=kv_window,
            kv_groups=kv_groups,
        )
        self.worker = FakeWorker(
            self.model,
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            num_cpu_blocks=config.num_cpu_blocks,
            verify_kv=verify_kv,
            drafter=proposer if drafted else None,
            window=self.scheduler.kv.window,
            # The keys verified: a windowed group's window once its blocks are released.
            groups=tuple(w if self.scheduler.kv.window else 0 for w in kv_groups)
            if len(kv_groups) > 1
            else (),
        )
        self.check = check_invariants
        self.engine = StepEngine(
            self.scheduler, InlineExecutor(self.worker.execute), check_invariants=check_invariants
        )
        total_tokens = sum(
            (r.prompt_len or len(r.prompt_token_ids or ())) + r.max_tokens * r.n for r in trace
        )
        last_arrival = max((r.arrival_step for r in trace), default=0)
        self.max_steps = max_steps or last_arrival + 20 * total_tokens + 100

    def prompt_of(self, req: TraceRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        return self.model.prompt(req.id, req.prompt_len or 0)

    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> SimResult:
        sched = self.scheduler
        result = SimResult(summary={})
        aborts: dict[int, list[str]] = defaultdict(list)
        for req in self.trace:
            if req.abort_step is not None:
                aborts[req.abort_step].append(req.id)
        priority_of = {r.id: r.priority for r in self.trace}
        arrival_of = {r.id: r.arrival_step for r in self.trace}
        pending = list(reversed(self.trace))
        requests = {}
        step_times: list[float] = []
        generated = 0
        peak_running = 0

        while pending or self.engine.has_work():
            step = sched.step
            if step >= self.max_steps:
                raise RuntimeError(f"simulation made no progress within {self.max_steps} steps")
            record_finished: list[dict[str, str]] = []
            record_rejected: list[dict[str, str]] = []
            while pending and pending[-1].arrival_step <= step:
                req = pending.pop()
                try:
                    requests[req.id] = sched.add_request(
                        req.id,
                        self.prompt_of(req),
                        req.params(),
                        priority=req.priority,
                        client=req.client or "",
                    )
                except RejectedError as exc:
                    result.rejected[req.id] = exc.message
                    record_rejected.append({"id": req.id, "reason": exc.message})
            for request_id in aborts.pop(step, ()):
                if sched.abort(request_id):
                    record_finished.append({"id": request_id, "reason": FinishReason.ABORT})

            output = self.engine.step()  # raises AssertionError on a broken invariant
            plan = output.plan
            peak_running = max(peak_running, len(sched.running))
            step_times.append(output.schedule_s + output.update_s)

            generated += len(output.new_tokens)
            for request_id in output.finished_requests:
                reason = requests[request_id].finish_reason
                record_finished.append({"id": request_id, "reason": str(reason)})
            if on_step is not None:
                on_step(
                    {
                        "step": plan.step,
                        "scheduled": dict(plan.num_scheduled_tokens),
                        "preempted": [{"id": s, "mode": m} for s, m in output.preempted],
                        "swapped_in": list(output.swapped_in),
                        "finished": record_finished,
                        "rejected": record_rejected,
                        "free_gpu_blocks": sched.kv.pool.num_free,
                        "free_cpu_blocks": sched.kv.cpu_pool.num_free,
                        "num_running": len(sched.running),
                        "num_waiting": len(sched.waiting),
                        "num_swapped": len(sched.swapped),
                        "prefix_hit_tokens": dict(output.prefix_hit_tokens),
                    }
                )

        waits: dict[int, list[float]] = defaultdict(list)
        for request_id, request in requests.items():
            result.outputs[request_id] = {s.seq_id: s.output_token_ids for s in request.seqs}
            result.finish_reasons[request_id] = str(request.finish_reason)
            for seq in request.seqs:
                result.seq_finish_reasons[seq.seq_id] = str(seq.finish_reason)
            if request.first_scheduled_step is not None:
                waits[priority_of[request_id]].append(
                    request.first_scheduled_step - arrival_of[request_id]
                )
        micros = [t * 1e6 for t in step_times]
        result.summary = {
            "steps": sched.step,
            "generated_tokens": generated,
            "finished": len(requests),
            "rejected": len(result.rejected),
            "preemptions": dict(sched.preemptions),
            "peak_running": peak_running,
            "released_blocks": sched.kv.released_blocks,
            "wait_steps": {
                str(p): {"max": max(w), "p99": percentile(w, 99)} for p, w in sorted(waits.items())
            },
            "step_time_us": summarize(micros) or {"mean": 0.0, "p50": 0.0, "p99": 0.0},
            "speculation": {
                "proposals": sched.speculation.num_drafts,
                "proposed_tokens": sched.speculation.num_draft_tokens,
                "accepted_tokens": sched.speculation.num_accepted_tokens,
            },
            "invariants_ok": True if self.check else None,  # checked after every step
            "leftover_blocks": {
                "gpu_in_use": sched.kv.pool.num_blocks - sched.kv.pool.num_free,
                "cpu_in_use": sched.kv.cpu_pool.num_blocks - sched.kv.cpu_pool.num_free,
            },
        }
        return result
