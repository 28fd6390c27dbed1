"""Where the steps' time goes: :class:`StepTimer` accumulates each step's parts.

The :class:`~scheduler_svc.step_engine.StepEngine` adds every step it applied (its
scheduling time, the wait from submit to result and the worker's
:class:`~ipc.schema.StepTiming`); whoever runs the
:class:`~scheduler_svc.outputs.OutputProcessor` adds its time per step (the daemon's
output task, ``LLM.step``). :meth:`StepTimer.recent` is the moving mean over the last
``window`` steps (``expeditor inspect``), :meth:`StepTimer.total` the mean over all of
them (``expeditor bench``), both as :class:`~ipc.schema.StepTimes` in milliseconds.

The parts: ``schedule`` = ``Scheduler.schedule()`` + ``update()``; ``transfer`` = submit
to result minus the worker's ``StepTiming.total_s`` (plan encoding, send, the worker's
receive, the result's way back; in-process only the call); ``prepare`` = the worker's
total minus swap, forward and sample (plan state, inputs); ``swap``, ``forward``,
``sample`` = the worker's ``StepTiming``; ``outputs`` = ``OutputProcessor.on_step``.
"""

from __future__ import annotations

from collections import deque

from ipc.schema import StepTimes, StepTiming

WINDOW = 100
"""Steps in the moving mean ``expeditor inspect`` shows."""

_PARTS = 6
"""schedule, transfer, prepare, swap, forward, sample: one step's parts, in seconds."""


class StepTimer:
    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self.steps = 0
        self.totals = [0.0] * _PARTS
        self.outputs_steps = 0
        self.outputs_total = 0.0
        self.flop = 0.0
        self._recent_flop: deque[float] = deque(maxlen=window)
        self._recent: deque[tuple[float, ...]] = deque(maxlen=window)
        self._recent_outputs: deque[float] = deque(maxlen=window)

    def add_step(self, core_s: float, execute_s: float, timing: StepTiming) -> None:
        """One step: ``core_s`` in ``schedule()`` + ``update()``, ``execute_s`` from
        submit to result, ``timing`` as the worker measured it. Negative differences
        (clocks of different processes, rounding) count as 0."""
        worker = timing.total_s
        parts = (
            core_s,
            max(0.0, execute_s - worker),
            max(0.0, worker - timing.swap_s - timing.forward_s - timing.sample_s),
            timing.swap_s,
            timing.forward_s,
            timing.sample_s,
        )
        self.steps += 1
        totals = self.totals
        for index, value in enumerate(parts):
            totals[index] += value
        self._recent.append(parts)
        self.flop += timing.forward_flop
        self._recent_flop.append(timing.forward_flop)

    def add_outputs(self, seconds: float) -> None:
        """One step's events through ``OutputProcessor.on_step``."""
        self.outputs_steps += 1
        self.outputs_total += seconds
        self._recent_outputs.append(seconds)

    def total(self) -> StepTimes:
        """Mean per step since the start."""
        return _times(self.totals, self.steps, self.outputs_total, self.outputs_steps, self.flop)

    def recent(self) -> StepTimes:
        """Mean per step over the last ``window`` steps (``steps``: how many that is)."""
        sums = [sum(column) for column in zip(*self._recent, strict=True)] or [0.0] * _PARTS
        outputs = self._recent_outputs
        return _times(sums, len(self._recent), sum(outputs), len(outputs), sum(self._recent_flop))


def _times(
    sums: list[float], steps: int, outputs_s: float, outputs_steps: int, flop: float
) -> StepTimes:
    ms = [1e3 * value / steps if steps else 0.0 for value in sums]
    forward_s = sums[4]
    return StepTimes(
        schedule=ms[0],
        transfer=ms[1],
        prepare=ms[2],
        swap=ms[3],
        forward=ms[4],
        sample=ms[5],
        outputs=1e3 * outputs_s / outputs_steps if outputs_steps else 0.0,
        steps=steps,
        forward_gflops=flop / forward_s / 1e9 if forward_s > 0 else 0.0,
    )
