"""The CPU swap pool's shared-memory segment (POSIX shm under /dev/shm).

The scheduler creates and owns it, workers map it; so KV swapped out survives a worker
restart. This module only deals in bytes (no torch): workers view the buffer as a
tensor of ``[num_blocks, *block_shape]`` (see ``gpu_worker.kv_cache``), so one pool
block holds all layers of one device block.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory


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
        name = name or f"expeditor-swap-{os.getpid()}-{secrets.token_hex(4)}"
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
