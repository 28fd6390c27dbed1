"""The scheduler's view of its worker processes: join, setup, heartbeats, loss.

A worker is lost when it is silent for ``timeout_s`` (no heartbeat), or, when it runs
in the scheduler's pid namespace (same :func:`~shared.procinfo.host_id`), as soon as
its process is gone: a replacement started by a supervisor is then accepted at once
instead of being refused until the dead one's heartbeats time out."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.schema import WorkerHello, WorkerInfo, WorkerJoin, WorkerStatus
from shared.procinfo import host_id, process_alive


@dataclass(slots=True)
class WorkerHandle:
    identity: bytes
    rank: int
    pid: int
    device: str
    last_seen: float
    state: WorkerStatus = WorkerStatus.STARTING
    hello: WorkerHello | None = None
    start_time: int = 0
    """The process's start time when it runs in this pid namespace (0: cannot watch it)."""

    def dead(self) -> bool:
        """Seen to have exited (only knowable for a process in this pid namespace)."""
        return bool(self.start_time) and not process_alive(self.pid, self.start_time)


class WorkerRegistry:
    """Workers by socket identity; a worker silent for ``timeout_s`` is lost."""

    MAX_LOST_SHOWN = 16

    def __init__(self, expected: int, timeout_s: float) -> None:
        self.expected = expected
        self.timeout_s = timeout_s
        self.workers: dict[bytes, WorkerHandle] = {}
        self.lost: list[WorkerHandle] = []
        self.ever_ready = False

    def join(
        self, identity: bytes, join: WorkerJoin, now: float
    ) -> tuple[WorkerHandle, WorkerHandle | None]:
        """Register a worker, and return the handle it replaces (now dropped) if the
        previous holder of its rank is seen dead; raises ValueError if that one lives
        or cannot be watched and has not timed out yet."""
        replaced = None
        for other in list(self.workers.values()):
            if other.rank == join.rank and other.identity != identity:
                if not other.dead():
                    raise ValueError(f"rank {join.rank} is already served by pid {other.pid}")
                replaced = self.drop(other.identity)
        local = bool(join.host) and join.host == host_id()
        handle = WorkerHandle(
            identity,
            join.rank,
            join.pid,
            join.device,
            last_seen=now,
            start_time=join.start_time if local else 0,
        )
        self.workers[identity] = handle
        return handle, replaced

    def get(self, identity: bytes) -> WorkerHandle | None:
        return self.workers.get(identity)

    def ready(self) -> list[WorkerHandle]:
        return sorted(
            (w for w in self.workers.values() if w.state is WorkerStatus.READY),
            key=lambda w: w.rank,
        )

    def mark_ready(self, handle: WorkerHandle, hello: WorkerHello) -> None:
        handle.hello = hello
        handle.state = WorkerStatus.READY
        self.ever_ready = True

    def drop(self, identity: bytes) -> WorkerHandle | None:
        handle = self.workers.pop(identity, None)
        if handle is not None:
            handle.state = WorkerStatus.LOST
            self.lost = [*self.lost, handle][-self.MAX_LOST_SHOWN :]
        return handle

    def expire(self, now: float) -> list[WorkerHandle]:
        """Drop and return the workers silent for longer than the timeout or seen dead."""
        gone = [
            w.identity
            for w in self.workers.values()
            if now - w.last_seen > self.timeout_s or w.dead()
        ]
        return [h for h in (self.drop(i) for i in gone) if h is not None]

    def info(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                rank=w.rank,
                pid=w.pid,
                device=w.device,
                state=w.state,
                num_gpu_blocks=w.hello.num_gpu_blocks if w.hello else None,
                group_size=w.hello.tensor_parallel_size if w.hello else 1,
            )
            for w in sorted(self.workers.values(), key=lambda w: w.rank) + self.lost
        ]
