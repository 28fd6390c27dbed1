"""gpu_worker.event_clock: a step's parts on the device's clock when the device is done
with them, on the host's otherwise (CUDA events faked: no GPU here)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from gpu_worker.event_clock import EventClock
from gpu_worker.staging import Staging

DEVICE_CLOCK = itertools.count(step=10)  # ms: each recorded event 10 ms after the last


class FakeEvent:
    """Records a device timestamp when recorded; ``elapsed_time`` in ms, as CUDA's."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing  # elapsed_time needs timing events
        self.at: int | None = None

    def record(self, stream: Any = None) -> None:
        self.at = next(DEVICE_CLOCK)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return float(end.at - self.at)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)


def test_off_cuda_parts_are_host_time() -> None:
    clock = EventClock(torch.device("cpu"))
    clock.start()
    clock.mark("a")
    total = sum(range(100_000))  # some host work between the marks
    clock.mark("b")
    assert total > 0
    host = clock._host["b"] - clock._host["a"]
    assert clock.between("a", "b", device_done=True) == host
    assert clock.between("a", "b", device_done=False) == host


def test_on_cuda_a_finished_step_is_measured_between_events(fake_cuda: None) -> None:
    clock = EventClock(torch.device("cuda", 0))
    clock.start()
    clock.mark("prepared")
    clock.mark("forwarded")
    clock.mark("read")
    assert clock.between("prepared", "forwarded", device_done=True) == pytest.approx(0.010)
    assert clock.between("start", "read", device_done=True) == pytest.approx(0.030)
    # Not done: the events may not have happened yet, so the host's clock is used.
    host = clock._host["read"] - clock._host["start"]
    assert clock.between("start", "read", device_done=False) == host


def test_the_staging_marks_the_read(fake_cuda: None) -> None:
    """The read of the tokens marks the end of the device's work on the step, before the
    host waits for it."""
    clock = EventClock(torch.device("cuda", 0))
    staging = Staging(torch.device("cpu"), clock)
    clock.start()
    assert "read" not in clock._events
    assert staging.to_host(torch.tensor([3, 4])) == [3, 4]
    assert staging.host_syncs == 1
    assert "read" in clock._events
