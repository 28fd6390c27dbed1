"""Swap segment hygiene: segments whose owner died (SIGKILL, OOM killer) are removed at
scheduler start-up and by ``expeditor cleanup-shm``; live owners' segments never are."""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_svc.launch import child_pids, running_server
from shared.procinfo import process_start_time
from shared.swap_pool import (
    SHM_DIR,
    SwapPoolSegment,
    remove_stale_segments,
    segment_owner,
)

is_root = pytest.mark.skipif(os.geteuid() != 0, reason="os.chown to another uid needs root")


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _stat_fields(pid: int) -> list[str]:
    """Fields 3 onwards of /proc/PID/stat (state, ppid, ...)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 1 :].split()


def _state(pid: int) -> str:
    return _stat_fields(pid)[0]


@pytest.fixture
def zombie() -> Iterator[int]:
    """A child that has exited but is not reaped yet: its pid still has a /proc entry."""
    proc = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while _state(proc.pid) != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.wait()


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _segment(shm_dir: Path, name: str, size: int = 4096) -> Path:
    path = shm_dir / name
    path.write_bytes(b"\0" * size)
    return path


# --------------------------------------------------------------------------- unit


def test_only_segments_of_dead_owners_of_this_user_are_removed(
    tmp_path: Path, zombie: int, sleeper: int
) -> None:
    me = os.getpid()
    started = process_start_time(me)
    assert started is not None
    sleeper_started = process_start_time(sleeper)
    zombie_started = int(_stat_fields(zombie)[19])  # process_start_time says None
    dead = _dead_pid()
    stale = {
        f"expeditor-swap-{dead}-{started}-0123abcd": 4096,  # no such process
        f"expeditor-swap-{me}-{started + 1}-0123abcd": 8192,  # pid reused by this process
        f"expeditor-swap-{zombie}-{zombie_started}-0123abcd": 100,  # exited, not reaped
    }
    kept = [
        f"expeditor-swap-{me}-{started}-0123abcd",  # this process: alive
        f"expeditor-swap-{sleeper}-{sleeper_started}-89abcdef",  # another live process
        f"expeditor-swap-{dead}-0123abcd",  # old-style name
        f"expeditor-swap-{dead}-{started}-0123abcd.bak",
        f"expeditor-swap-{dead}-{started}-0123ABCD",
        f"expeditor-swap-{dead}-{started}-0123abc",
        f"expeditor-swap-x-{started}-0123abcd",
        f"psm_{dead}",
    ]
    for name, size in stale.items():
        _segment(tmp_path, name, size)
    for name in kept:
        _segment(tmp_path, name)
    (tmp_path / f"expeditor-swap-{dead}-{started}-deadbeef").mkdir()  # not a regular file
    kept.append(f"expeditor-swap-{dead}-{started}-deadbeef")

    removed = remove_stale_segments(tmp_path)

    assert {(segment.name, segment.size) for segment in removed} == set(stale.items())
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(kept)
    assert remove_stale_segments(tmp_path) == []


@is_root
def test_segments_of_other_users_are_left_alone(tmp_path: Path) -> None:
    started = process_start_time(os.getpid())
    dead = _dead_pid()
    mine = _segment(tmp_path, f"expeditor-swap-{dead}-{started}-00000001")
    theirs = _segment(tmp_path, f"expeditor-swap-{dead}-{started}-00000002")
    os.chown(theirs, 12345, 12345)
    assert [segment.name for segment in remove_stale_segments(tmp_path)] == [mine.name]
    assert theirs.exists() and not mine.exists()


def test_start_time_survives_a_comm_with_spaces_and_parentheses() -> None:
    """Field 2 (comm) is free text: fields are counted from its last ')'."""
    code = (
        "import ctypes, sys\n"
        "sys.stdin.readline()\n"
        "ctypes.CDLL(None).prctl(15, b') R 1 (2 3')\n"  # PR_SET_NAME
        "print('renamed', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        before = process_start_time(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "renamed\n"
        assert "(2 3)" in Path(f"/proc/{proc.pid}/stat").read_text()
        assert process_start_time(proc.pid) == before is not None
    finally:
        proc.kill()
        proc.wait()


def test_a_real_segment_names_this_process_as_its_owner() -> None:
    with SwapPoolSegment.create(2, 4096) as segment:
        assert segment_owner(segment.name) == (os.getpid(), process_start_time(os.getpid()))
        assert (SHM_DIR / segment.name).exists()
        assert segment.name not in {removed.name for removed in remove_stale_segments()}
        assert (SHM_DIR / segment.name).exists()


def test_a_zombie_group_leader_with_live_threads_is_alive() -> None:
    """The main thread exited (pthread_exit) but the process still runs: keep its segment."""
    code = (
        "import ctypes, os, sys, threading\n"
        "threading.Thread(target=sys.stdin.readline).start()\n"
        "print('ok', flush=True)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "ok\n"
        deadline = time.monotonic() + 10
        while _state(proc.pid) != "Z":
            assert time.monotonic() < deadline, "the main thread never exited"
            time.sleep(0.01)
        assert process_start_time(proc.pid) is not None
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- end to end


def _read_line(stream: int, timeout_s: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while not data.endswith(b"\n"):
            assert time.monotonic() < deadline, "serve printed no address"
            if selector.select(timeout=0.2):
                chunk = os.read(stream, 4096)
                assert chunk, "serve exited before printing its address"
                data += chunk
    finally:
        selector.close()
    return data.decode().strip()


def _segments_of(pids: list[int]) -> list[Path]:
    """Swap segments whose name (old or new style) starts with one of ``pids``."""
    prefix = re.compile(r"expeditor-swap-(\d+)-")
    found = []
    for path in SHM_DIR.glob("expeditor-swap-*"):
        match = prefix.match(path.name)
        if match and int(match[1]) in pids:
            found.append(path)
    return found


def test_segment_leaked_by_a_sigkilled_serve_is_removed_by_the_next_start(
    model: Path, tmp_path: Path
) -> None:
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "expeditor", "serve", "--model", str(model)]
        + ["--num-cpu-blocks", "64"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=log,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert serve.stdout is not None
    leaked: list[Path] = []
    rundir: Path | None = None
    try:
        address = _read_line(serve.stdout.fileno(), 120)
        if address.startswith("ipc://"):
            rundir = Path(address.removeprefix("ipc://")).parent
        deadline = time.monotonic() + 60
        while not (leaked := _segments_of(child_pids(serve.pid))):
            assert time.monotonic() < deadline, "no swap segment of a child of serve appeared"
            time.sleep(0.1)
        os.killpg(serve.pid, signal.SIGKILL)  # serve, scheduler and workers: no clean-up
        serve.wait()
        assert all(path.exists() for path in leaked), "the segment should leak on SIGKILL"

        with running_server(model, "--num-cpu-blocks", "64") as (_, second):
            assert second.poll() is None
            assert [path for path in leaked if path.exists()] == []
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        serve.stdout.close()
        log.close()
        for path in leaked:
            path.unlink(missing_ok=True)
        tmp = Path(tempfile.gettempdir())
        if rundir is not None and rundir.parent == tmp and rundir.name.startswith("expeditor-"):
            shutil.rmtree(rundir, ignore_errors=True)


def test_cleanup_shm_command_removes_stale_segments_only() -> None:
    started = process_start_time(os.getpid())
    assert started is not None
    stale = SHM_DIR / f"expeditor-swap-{_dead_pid()}-{started}-{os.urandom(4).hex()}"
    try:
        _segment(SHM_DIR, stale.name, 8192)
        with SwapPoolSegment.create(1, 4096) as live:
            result = subprocess.run(
                [sys.executable, "-m", "expeditor", "cleanup-shm"],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert result.returncode == 0, result.stderr
            lines = result.stdout.splitlines()
            assert f"removed {stale.name} (8192 bytes)" in lines
            assert not any(live.name in line for line in lines)
            assert re.fullmatch(r"removed \d+ stale swap segment\(s\), \d+ bytes", lines[-1])
            assert not stale.exists()
            assert (SHM_DIR / live.name).exists()
    finally:
        stale.unlink(missing_ok=True)
