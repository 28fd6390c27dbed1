"""The step: schedule -> execute -> update, the one loop body every driver runs.

The daemon (:mod:`scheduler_svc.daemon`, remote workers), the in-process engine
(:class:`expeditor.llm.LLM`, one model runner), the simulator and the tests (a
fake worker) all call :meth:`StepEngine.step` (or :meth:`StepEngine.step_async` on an
event loop) and differ only in their :class:`Executor` and in what they do with the
:class:`StepRecord`: the daemon hands its events to the output task, ``LLM`` runs the
same :class:`~scheduler_svc.outputs.OutputProcessor` inline, the simulator records the
plan.

An executor takes a plan and returns a future of its result without waiting for it,
so the engine plans the next step while this one runs (overlapped scheduling, the
core's ``overlap_scheduling``): each :meth:`StepEngine.step` first fills the pipeline
(plan and submit while the core may plan ahead), then waits for the oldest step's
result and applies it. With an asynchronous executor (worker processes) the workers
start step N+1 the moment step N ends, and the scheduler's planning, its update and
the output processing of step N-1 run meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.introspection import check_invariants
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import UpdateOutcome
from scheduler_svc.outputs import StepEvents
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
    """From submitting the plan, or from the previous step's result when it was
    submitted ahead of it, to having its result (the worker's time included)."""
    planned_at: float = 0.0
    """``time.monotonic()`` when the plan was made (when its new requests left the queue)."""


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
        self.pending: deque[tuple[StepRecord, Future[StepResult], float]] = deque()
        """Submitted steps, oldest first, with their submission times."""
        self._last_result = 0.0

    def has_work(self) -> bool:
        return bool(self.pending) or self.core.has_work()

    def step(self) -> StepRecord:
        """Plan and submit what may be planned, then wait for the oldest step's result
        and apply it."""
        record, future, submitted = self._next()
        try:
            result = future.result()
        except StepLostError:
            return self._lost(record)
        return self._apply(record, result, submitted)

    async def step_async(self) -> StepRecord:
        """:meth:`step` for an event loop: waits for the result without blocking it."""
        record, future, submitted = self._next()
        try:
            result = await asyncio.wrap_future(future)
        except StepLostError:
            return self._lost(record)
        return self._apply(record, result, submitted)

    def stop_seq(self, seq_id: str) -> str | None:
        """A stop string ended sample ``seq_id``: end it in the core. Returns its request
        id when that was the request's last unfinished sample."""
        seq = self.core.seqs.get(seq_id)
        if seq is None:
            return None
        self.core.finish_seq(seq_id, FinishReason.STOP)
        return seq.request.request_id if seq.request.finished else None

    def on_worker_lost(self) -> list[Request]:
        """A worker was lost while it owed no step: re-queue. Results not applied yet
        are dropped with the device cache they describe."""
        self.pending.clear()
        return self.core.on_worker_lost()

    # -- the parts ----------------------------------------------------------------------

    def _next(self) -> tuple[StepRecord, Future[StepResult], float]:
        """Fill the pipeline; the oldest submitted step."""
        core, pending = self.core, self.pending
        if pending and _failed(pending[0][1]):
            return pending.popleft()  # lost: nothing is planned on top of it
        while not pending or (
            not _failed(pending[-1][1]) and core.can_plan_ahead() and core.has_work()
        ):
            started = time.perf_counter()
            plan = core.schedule()
            if plan is None:
                break  # nothing to plan until a result is back
            record = StepRecord(
                plan=plan, schedule_s=time.perf_counter() - started, planned_at=time.monotonic()
            )
            self._check("planning", plan.step)
            pending.append((record, self.executor.submit(plan), time.perf_counter()))
        return pending.popleft()

    def _apply(self, record: StepRecord, result: StepResult, submitted: float) -> StepRecord:
        inflight = self.core.inflight
        if not inflight or inflight[0].step != record.plan.step:
            # A worker was lost after this result arrived (on_worker_lost re-queued).
            return record
        started = time.perf_counter()
        record.execute_s = started - max(submitted, self._last_result)
        self._last_result = started
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
            scheduled_requests=[
                (n.request_id, n.num_computed_tokens)
                for n in record.plan.new_seqs
                if n.sample_index == 0
            ],
            num_scheduled_tokens=record.plan.total_tokens,
            planned_at=record.planned_at,
            time=time.monotonic(),
        )
        self.times.add_step(record.schedule_s + record.update_s, record.execute_s, result.timing)
        self._check("the update", record.plan.step)
        return record

    def _lost(self, record: StepRecord) -> StepRecord:
        self.pending.clear()  # the steps submitted after it are lost with it
        record.quarantined = self.core.on_worker_lost()
        self._check("a lost step", record.plan.step)
        return record

    def _check(self, after: str, step: int) -> None:
        if self.check_invariants and (problems := check_invariants(self.core)):
            raise AssertionError(f"step {step}, after {after}: " + "; ".join(problems))


def _failed(future: Future[StepResult]) -> bool:
    return future.done() and future.exception() is not None
