"""The step: schedule -> execute -> update, the one loop body every driver runs.

The daemon (:mod:`scheduler_svc.daemon`, remote workers), the in-process engine
(:class:`expeditor.llm.LLM`, one model runner), the simulator and the tests (a
fake worker) all call :meth:`StepEngine.step` (or :meth:`StepEngine.step_async` on an
event loop) and differ only in their :class:`Executor` and in what they do with the
:class:`~scheduler_svc.core.step_records.StepOutput` it returns: the daemon hands it to
the output task, ``LLM`` runs the same :class:`~scheduler_svc.outputs.OutputProcessor`
inline, the simulator records the plan.

An executor takes a plan and returns a future of its result without waiting for it,
so the engine plans the next step while this one runs (overlapped scheduling, the
core's ``overlap_scheduling``; off, one step is in flight at a time and the same loop
runs): each :meth:`StepEngine.step` first fills the pipeline (plan and submit while
the core may plan ahead), then waits for the oldest step's result and applies it.
With an asynchronous executor (worker processes) the workers start step N+1 the
moment step N ends, and the scheduler's planning, its update and the output
processing of step N-1 run meanwhile.

The steps in flight are the core's ``Scheduler.inflight``; the engine keeps each
step's future on its entry (:class:`~scheduler_svc.core.step_records.InflightStep`)
and holds no queue of its own, so a lost worker is cleared in one place,
``Scheduler.on_worker_lost``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.introspection import check_invariants
from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import InflightStep, StepOutput
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
        self._last_result = 0.0

    def has_work(self) -> bool:
        """Steps in flight to collect, or work to plan."""
        return bool(self.core.inflight) or self.core.has_work()

    def futures(self) -> list[Future[StepResult]]:
        """The futures of the steps in flight, oldest first (an executor that tracks its
        steps asks here: the core's queue is the only one)."""
        return [step.future for step in self.core.inflight if step.future is not None]

    def step(self) -> StepOutput:
        """Plan and submit what may be planned, then wait for the oldest step's result
        and apply it."""
        oldest = self._fill()
        assert oldest.future is not None
        try:
            result = oldest.future.result()
        except StepLostError:
            return self._lost(oldest)
        return self._apply(oldest, result)

    async def step_async(self) -> StepOutput:
        """:meth:`step` for an event loop: waits for the result without blocking it."""
        oldest = self._fill()
        assert oldest.future is not None
        try:
            result = await asyncio.wrap_future(oldest.future)
        except StepLostError:
            return self._lost(oldest)
        return self._apply(oldest, result)

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
        return self.core.on_worker_lost()

    # -- the parts ----------------------------------------------------------------------

    def _fill(self) -> InflightStep:
        """Fill the pipeline; the oldest step in flight."""
        core = self.core
        inflight = core.inflight
        if inflight and _failed(inflight[0]):
            return inflight[0]  # lost: nothing is planned on top of it
        while not inflight or (
            not _failed(inflight[-1]) and core.can_plan_ahead() and core.has_work()
        ):
            started = time.perf_counter()
            plan = core.schedule()
            if plan is None:
                break  # nothing to plan until a result is back
            planned = inflight[-1]
            output = planned.output
            assert output is not None
            output.schedule_s = time.perf_counter() - started
            output.planned_at = time.monotonic()
            self._check("planning", plan.step)
            planned.future = self.executor.submit(plan)
            planned.submitted = time.perf_counter()
        return inflight[0]

    def _apply(self, step: InflightStep, result: StepResult) -> StepOutput:
        output = step.output
        assert output is not None
        inflight = self.core.inflight
        if not inflight or inflight[0] is not step:
            # A worker was lost after this result arrived (on_worker_lost re-queued).
            output.lost = True
            return output
        started = time.perf_counter()
        output.execute_s = started - max(step.submitted, self._last_result)
        self._last_result = started
        self.core.update(result)
        output.update_s = time.perf_counter() - started
        output.time = time.monotonic()
        self.times.add_step(output.schedule_s + output.update_s, output.execute_s, result.timing)
        self._check("the update", output.plan.step)
        return output

    def _lost(self, step: InflightStep) -> StepOutput:
        output = step.output
        assert output is not None
        output.lost = True
        output.quarantined = self.core.on_worker_lost()  # the steps after it go with it
        self._check("a lost step", output.plan.step)
        return output

    def _check(self, after: str, step: int) -> None:
        if self.check_invariants and (problems := check_invariants(self.core)):
            raise AssertionError(f"step {step}, after {after}: " + "; ".join(problems))


def _failed(step: InflightStep) -> bool:
    future = step.future
    return future is not None and future.done() and future.exception() is not None
