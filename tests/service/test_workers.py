"""The worker registry: joins, ranks, and seeing a worker's death at once when it runs
in the scheduler's pid namespace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ipc.schema import WorkerJoin
from scheduler_svc.workers import WorkerRegistry
from shared.procinfo import host_id, process_alive, process_start_time


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _join(proc: subprocess.Popen[bytes], rank: int = 0, *, local: bool = True) -> WorkerJoin:
    return WorkerJoin(
        rank=rank,
        pid=proc.pid,
        device="cpu",
        host=host_id() if local else "another-host",
        start_time=process_start_time(proc.pid) or 0,
    )


def test_procinfo_tells_a_live_process_from_a_dead_or_reused_pid() -> None:
    me = os.getpid()
    start = process_start_time(me)
    assert start is not None and process_alive(me, start)
    assert not process_alive(me, start + 1)  # same pid, another process
    proc = _child()
    child_start = process_start_time(proc.pid)
    assert child_start is not None
    proc.kill()
    proc.wait()
    assert process_start_time(proc.pid) is None
    assert not process_alive(proc.pid, child_start)
    assert host_id() and host_id() == host_id()


def test_a_dead_local_workers_rank_is_taken_over_at_once() -> None:
    registry = WorkerRegistry(expected=1, timeout_s=120.0)
    old, new = _child(), _child()
    try:
        first, replaced = registry.join(b"old", _join(old), now=0.0)
        assert replaced is None and first.start_time
        with pytest.raises(ValueError, match="already served"):
            registry.join(b"new", _join(new), now=1.0)  # the old one lives
        old.kill()
        old.wait()
        handle, replaced = registry.join(b"new", _join(new), now=2.0)
        assert replaced is first and replaced.state == "lost"
        assert list(registry.workers) == [b"new"] and handle.pid == new.pid
    finally:
        for proc in (old, new):
            proc.kill()
            proc.wait()


def test_a_dead_local_worker_expires_before_its_heartbeat_timeout() -> None:
    registry = WorkerRegistry(expected=1, timeout_s=120.0)
    proc = _child()
    try:
        registry.join(b"w", _join(proc), now=0.0)
        assert registry.expire(now=1.0) == []
        proc.kill()
        proc.wait()
        assert [h.identity for h in registry.expire(now=1.0)] == [b"w"]
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_of_another_host_is_only_timed_out() -> None:
    registry = WorkerRegistry(expected=1, timeout_s=5.0)
    proc = _child()
    proc.kill()
    proc.wait()
    handle, _ = registry.join(b"w", _join(proc, local=False), now=0.0)
    assert handle.start_time == 0  # its pid means nothing here
    assert registry.expire(now=1.0) == []
    with pytest.raises(ValueError, match="already served"):
        registry.join(b"other", _join(proc, local=False), now=1.0)
    assert [h.identity for h in registry.expire(now=6.0)] == [b"w"]
