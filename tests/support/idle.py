"""Waiting for a running scheduler to hold nothing, with every KV block back."""

from __future__ import annotations

import time

from ipc.client import Client
from support.limits import SAFETY_S


def wait_idle(frontend: str) -> None:
    """Until the scheduler holds no sequence; asserts every device block is free."""
    with Client(frontend, timeout=10) as client:
        deadline = time.monotonic() + SAFETY_S
        while True:
            snap = client.inspect().snapshot
            assert snap is not None
            if not snap.seqs:
                break
            assert time.monotonic() < deadline, f"requests still held: {snap.seqs}"
            time.sleep(0.05)
        assert snap.gpu_blocks.free == snap.gpu_blocks.total
