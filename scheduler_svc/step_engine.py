"""The step: schedule -> execute -> update, the one loop body every driver runs.

The daemon (:mod:`scheduler_svc.daemon`, remote workers), the in-process engine
(:class:`gpu_worker.engine.LLM`, one model runner), the simulator and the tests (a
fake worker) all call :meth:`StepEngine.step` (or :meth:`StepEngine.step_async` on an
event loop) and differ only in their :class:`Executor` and in what they do with the
:class:`StepRecord`: the daemon hands its events to the output task, ``LLM`` runs the
same :class:`~scheduler_svc.outputs.OutputProcessor` inline, the simulator records the
plan.

An executor takes a plan and returns a future of its result without waiting for it,
so a driver can plan the next step while this one runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from ipc.schema import BatchPlan, StepResult
from scheduler_svc.introspection import check_invariants
from scheduler_svc.outputs import StepEvents
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.step_records import UpdateOutcome
from scheduler_svc.step_times import StepTimer
from shared.outputs import FinishReason


class StepLostError(RuntimeError):
    """The executor lost the step: a worker died or hung while running it, so the
    device cache is gone (the step is re-planned from the core's state)."""


class Executor(Protocol):
    def submit(self, plan: BatchPlan) -> Future[StepResult]:
        """Start running ``plan``; the future ends with its result, or with
        :class:`StepLostError` when a worker was lost during it."""
        ...


class InlineExecutor:
    """Runs each plan at once in the caller's thread (a model runner, a fake worker)."""

    def __init__(self, execute: Callable[[BatchPlan], StepResult]) -> None:
        self.execute = execute

    def submit(self, plan: BatchPlan) -> Future[StepResult]:
        future: Future[StepResult] = Future()
        try:
            future.set_result(self.execute(plan))
        except BaseException as exc:
            future.set_exception(exc)
        return future


@dataclass(slots=True)
class StepRecord:
    """One step as it happened."""

    plan: BatchPlan
    result: StepResult | None = None
    """None when the step was lost."""
    outcome: UpdateOutcome = field(default_factory=UpdateOutcome)
    events: StepEvents = field(default_factory=StepEvents)
    """What clients must hear of it (for an :class:`OutputProcessor`)."""
    quarantined: list[Request] = field(default_factory=list)
    """Requests ended because steps holding them were lost twice (a lost step only)."""
    schedule_s: float = 0.0
    update_s: float = 0.0
    """Time in the core: ``schedule()``, and ``update()`` (the events not included)."""
    execute_s: float = 0.0
    """From submitting the plan to having its result (the worker's time included)."""


class StepEngine:
    """Drives a :class:`Scheduler` with an :class:`Executor`, one step at a time.

    With ``check_invariants`` every step asserts the core's invariants after planning
    and after the update (the simulator and the tests; too slow for serving). Every
    applied step is added to ``times`` (where its time went).
    """

    def __init__(
        self,
        core: Scheduler,
        executor: Executor,
        *,
        check_invariants: bool = False,
        times: StepTimer | None = None,
    ) -> None:
        self.core = core
        self.executor = executor
        self.check_invariants = check_invariants
        self.times = times if times is not None else StepTimer()

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> StepRecord:
        """Plan, run and apply one step, waiting for its result."""
        record = self._plan()
        started = time.perf_counter()
        try:
            result = self.executor.submit(record.plan).result()
        except StepLostError:
            return self._lost(record)
        return self._apply(record, result, started)

    async def step_async(self) -> StepRecord:
        """:meth:`step` for an event loop: waits for the result without blocking it."""
        record = self._plan()
        started = time.perf_counter()
        try:
            result = await asyncio.wrap_future(self.executor.submit(record.plan))
        except StepLostError:
            return self._lost(record)
        return self._apply(record, result, started)

    def stop_seq(self, seq_id: str) -> str | None:
        """A stop string ended sample ``seq_id``: end it in the core. Returns its request
        id when that was the request's last unfinished sample."""
        seq = self.core.seqs.get(seq_id)
        if seq is None:
            return None
        self.core.finish_seq(seq_id, FinishReason.STOP)
        return seq.request.request_id if seq.request.finished else None

    def on_worker_lost(self) -> list[Request]:
        """A worker was lost between steps: re-queue (nothing was in flight)."""
        return self.core.on_worker_lost()

    # -- the parts ----------------------------------------------------------------------

    def _plan(self) -> StepRecord:
        started = time.perf_counter()
        plan = self.core.schedule()
        record = StepRecord(plan=plan, schedule_s=time.perf_counter() - started)
        self._check("planning", plan.step)
        return record

    def _apply(self, record: StepRecord, result: StepResult, submitted: float) -> StepRecord:
        started = time.perf_counter()
        record.execute_s = started - submitted
        outcome = self.core.update(result)
        record.update_s = time.perf_counter() - started
        record.result = result
        record.outcome = outcome
        record.events = StepEvents(
            tokens=[
                (s.request.request_id, s.sample_index, s.seq_id, s.token_ids[-1])
                for s in outcome.advanced
            ],
            finished_seqs=[
                (s.request.request_id, s.sample_index, s.finish_reason) for s in outcome.finished
            ],
            finished_requests=[r.request_id for r in outcome.finished_requests],
            logprobs=outcome.logprobs,
            scheduled_requests=[n.request_id for n in record.plan.new_seqs],
            time=time.monotonic(),
        )
        self.times.add_step(record.schedule_s + record.update_s, record.execute_s, result.timing)
        self._check("the update", record.plan.step)
        return record

    def _lost(self, record: StepRecord) -> StepRecord:
        record.quarantined = self.core.on_worker_lost()
        self._check("a lost step", record.plan.step)
        return record

    def _check(self, after: str, step: int) -> None:
        if self.check_invariants and (problems := check_invariants(self.core)):
            raise AssertionError(f"step {step}, after {after}: " + "; ".join(problems))
