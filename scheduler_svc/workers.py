"""The scheduler's view of its worker processes: join, setup, heartbeats, loss."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.schema import WorkerHello, WorkerInfo, WorkerJoin


@dataclass(slots=True)
class WorkerHandle:
    identity: bytes
    rank: int
    pid: int
    device: str
    last_seen: float
    state: str = "starting"
    """``starting`` (loading the model), ``ready`` (hello received), ``lost``."""
    hello: WorkerHello | None = None


class WorkerRegistry:
    """Workers by socket identity; a worker silent for ``timeout_s`` is lost."""

    MAX_LOST_SHOWN = 16

    def __init__(self, expected: int, timeout_s: float) -> None:
        self.expected = expected
        self.timeout_s = timeout_s
        self.workers: dict[bytes, WorkerHandle] = {}
        self.lost: list[WorkerHandle] = []
        self.ever_ready = False

    def join(self, identity: bytes, join: WorkerJoin, now: float) -> WorkerHandle:
        """Register a worker; raises ValueError if a live worker already has its rank."""
        for other in self.workers.values():
            if other.rank == join.rank and other.identity != identity:
                raise ValueError(f"rank {join.rank} is already served by pid {other.pid}")
        handle = WorkerHandle(identity, join.rank, join.pid, join.device, last_seen=now)
        self.workers[identity] = handle
        return handle

    def get(self, identity: bytes) -> WorkerHandle | None:
        return self.workers.get(identity)

    def ready(self) -> list[WorkerHandle]:
        return sorted(
            (w for w in self.workers.values() if w.state == "ready"), key=lambda w: w.rank
        )

    def mark_ready(self, handle: WorkerHandle, hello: WorkerHello) -> None:
        handle.hello = hello
        handle.state = "ready"
        self.ever_ready = True

    def drop(self, identity: bytes) -> WorkerHandle | None:
        handle = self.workers.pop(identity, None)
        if handle is not None:
            handle.state = "lost"
            self.lost = [*self.lost, handle][-self.MAX_LOST_SHOWN :]
        return handle

    def expire(self, now: float) -> list[WorkerHandle]:
        """Drop and return the workers silent for longer than the timeout."""
        silent = [w.identity for w in self.workers.values() if now - w.last_seen > self.timeout_s]
        return [h for h in (self.drop(i) for i in silent) if h is not None]

    def info(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(
                rank=w.rank,
                pid=w.pid,
                device=w.device,
                state=w.state,
                num_gpu_blocks=w.hello.num_gpu_blocks if w.hello else None,
            )
            for w in sorted(self.workers.values(), key=lambda w: w.rank) + self.lost
        ]
