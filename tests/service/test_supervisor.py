"""`expeditor serve`'s supervisor: restarting workers without a tight crash loop."""

from __future__ import annotations

import itertools
import shutil

import pytest

from scheduler_svc import supervisor as supervisor_module
from scheduler_svc.supervisor import Supervisor
from shared.config import SchedulerConfig
from shared.server_config import ServerConfig


class _DeadProc:
    returncode = 1

    def poll(self) -> int:
        return self.returncode


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sup(monkeypatch: pytest.MonkeyPatch):
    clock = _Clock()
    monkeypatch.setattr(supervisor_module.time, "monotonic", clock)
    made = Supervisor(ServerConfig(), SchedulerConfig())
    made.ready = True
    spawns: list[float] = []

    def spawn(*args: str) -> _DeadProc:
        spawns.append(clock.now)
        return _DeadProc()  # dies at once, every time

    monkeypatch.setattr(made, "_spawn", spawn)
    yield made, clock, spawns
    shutil.rmtree(made.rundir, ignore_errors=True)


def test_a_worker_dying_at_once_is_restarted_with_a_growing_delay(sup) -> None:
    made, clock, spawns = sup
    made._spawn_worker(0)
    for _ in range(400):  # 40 s of supervision at 0.1 s
        made._restart_dead_workers()
        clock.now += 0.1
    gaps = [b - a for a, b in itertools.pairwise(spawns)]
    delays = [0.5, 1.0, 2.0, 4.0, 8.0] + [10.0] * (len(gaps) - 5)
    # Each death is seen on the next 0.1 s tick, the restart on the first tick after.
    assert all(0 <= gap - delay <= 0.25 for gap, delay in zip(gaps, delays, strict=True)), gaps
    assert len(spawns) < 12  # not 400


def test_a_worker_that_ran_a_while_is_restarted_at_once(sup) -> None:
    made, clock, spawns = sup
    made._spawn_worker(0)
    clock.now += 60.0  # it served for a minute, then died
    made._restart_dead_workers()
    assert len(spawns) == 2 and spawns[1] == clock.now
