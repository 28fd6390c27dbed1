"""The CPU swap pool's shared-memory segment (POSIX shm under /dev/shm).

The scheduler creates and owns it, workers map it; so KV swapped out survives a worker
restart. This module only deals in bytes (no torch): workers view the buffer as a
tensor of ``[num_blocks, *block_shape]`` (see ``gpu_worker.kv_cache``), so one pool
block holds all layers of one device block.

Segment names say who owns them: ``expeditor-swap-{pid}-{starttime}-{8 hex digits}``,
where ``starttime`` is the owner's start time from ``/proc/PID/stat`` (clock ticks
since boot). The pair survives pid reuse, so ``remove_stale_segments`` can tell a
segment whose owner died without cleaning up (SIGKILL, the OOM killer) from a live one.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

from shared.procinfo import process_alive, process_start_time

log = logging.getLogger("expeditor.swap_pool")

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "expeditor-swap-"
_SEGMENT_NAME = re.compile(r"expeditor-swap-([1-9][0-9]*)-([0-9]+)-[0-9a-f]{8}")


def _segment_name() -> str:
    """A fresh name for a segment owned by this process; without /proc (not Linux) the
    old-style ``expeditor-swap-{pid}-{hex}``, which ``remove_stale_segments`` never removes."""
    pid = os.getpid()
    start_time = process_start_time(pid)
    owner = f"{pid}-{start_time}" if start_time is not None else str(pid)
    return f"{SEGMENT_PREFIX}{owner}-{secrets.token_hex(4)}"


def segment_owner(name: str) -> tuple[int, int] | None:
    """(pid, start time) of the process that created segment ``name``; None when the name
    is not of the form ``expeditor-swap-{pid}-{starttime}-{8 hex digits}``."""
    match = _SEGMENT_NAME.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True)
class RemovedSegment:
    """A segment ``remove_stale_segments`` unlinked, and its size in bytes."""

    name: str
    size: int


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[RemovedSegment]:
    """Unlink the swap segments in ``shm_dir`` left behind by owners that died.

    A segment is removed only if its name parses (see ``segment_owner``), it belongs to
    this process's effective uid, and its owner is gone: no process has that pid, the
    one that has it started at another time (the pid was reused), or it is a zombie.
    Segments of live owners, of other users, and names that do not parse (the old
    ``expeditor-swap-{pid}-{hex}`` ones included) are left alone. Pids are looked up in
    this process's /proc, so the owners must share its pid namespace, which holds for
    every process that shares a /dev/shm in a standard deployment (systemd, one
    container). Does nothing when /proc cannot be read: every owner would look dead.
    """
    if process_start_time(os.getpid()) is None:
        log.warning("not removing stale swap segments: /proc is not readable")
        return []
    try:
        names = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    uid = os.geteuid()
    removed: list[RemovedSegment] = []
    for name in names:
        owner = segment_owner(name)
        if owner is None:
            continue
        path = shm_dir / name
        try:
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or process_alive(*owner):
                continue
            os.unlink(path)
        except FileNotFoundError:  # raced with its owner or another cleaner
            continue
        except OSError as exc:  # never fatal: this runs at scheduler start-up
            log.warning("cannot remove stale swap segment %s: %s", name, exc)
            continue
        removed.append(RemovedSegment(name, info.st_size))
        log.info(
            "removed stale swap segment %s (%d bytes; owner pid %d is gone)",
            name,
            info.st_size,
            owner[0],
        )
    if removed:
        log.info(
            "removed %d stale swap segment(s), %d bytes",
            len(removed),
            sum(segment.size for segment in removed),
        )
    return removed


class SwapPoolSegment:
    """A named shared-memory segment of ``num_blocks * bytes_per_block`` bytes."""

    def __init__(self, shm: shared_memory.SharedMemory, *, owner: bool) -> None:
        self._shm: shared_memory.SharedMemory | None = shm
        self.owner = owner

    @classmethod
    def create(
        cls, num_blocks: int, bytes_per_block: int, name: str | None = None
    ) -> SwapPoolSegment:
        if num_blocks < 0 or bytes_per_block <= 0:
            raise ValueError(
                f"swap pool needs num_blocks >= 0 and bytes_per_block > 0, got "
                f"{num_blocks} x {bytes_per_block}"
            )
        name = name or _segment_name()
        size = max(1, num_blocks * bytes_per_block)
        return cls(shared_memory.SharedMemory(name=name, create=True, size=size), owner=True)

    @classmethod
    def attach(cls, name: str) -> SwapPoolSegment:
        """Map an existing segment; the attaching process never unlinks it."""
        try:
            shm = shared_memory.SharedMemory(name=name, create=False)
        except FileNotFoundError:
            raise FileNotFoundError(f"swap pool segment {name!r} does not exist") from None
        # Python < 3.13 registers attached segments with the resource tracker, which
        # would unlink the owner's segment when this process exits.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self._require().name

    @property
    def buf(self) -> memoryview:
        buf = self._require().buf
        assert buf is not None
        return buf

    @property
    def size(self) -> int:
        return self._require().size

    def _require(self) -> shared_memory.SharedMemory:
        if self._shm is None:
            raise ValueError("swap pool segment is closed")
        return self._shm

    def close(self) -> None:
        """Unmap (and, for the owner, remove) the segment. Views of it must be gone."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        shm.close()
        if self.owner:
            shm.unlink()

    def __enter__(self) -> SwapPoolSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
