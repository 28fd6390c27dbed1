"""The worker daemon against a fake scheduler socket: heartbeats keep coming while the
model loads, so a slow load is not taken for a dead worker."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import zmq
from support.limits import DAEMON_SAFETY_S

from gpu_worker.daemon import WorkerDaemon
from ipc.schema import (
    Shutdown,
    WorkerHello,
    WorkerJoin,
    WorkerSetup,
    encode,
    worker_decoder,
)
from shared.worker_settings import WorkerSettings

BEATS_WHILE_LOADING = 2


def _fake_scheduler(sock: zmq.Socket, seen: list[str], beats: threading.Event) -> None:
    """Answer the join with a setup, note every frame until the hello, then dismiss;
    set ``beats`` once BEATS_WHILE_LOADING heartbeats came."""
    if not sock.poll(10_000):
        return
    identity, frame = sock.recv_multipart()
    seen.append(type(worker_decoder.decode(frame)).__name__)
    settings = WorkerSettings.of(model="slow", block_size=16, max_num_batched_tokens=64)
    setup = WorkerSetup(settings=settings)
    sock.send_multipart([identity, encode(setup)])
    while seen[-1] != WorkerHello.__name__ and sock.poll(10_000):
        seen.append(type(worker_decoder.decode(sock.recv_multipart()[1])).__name__)
        if seen.count("Heartbeat") >= BEATS_WHILE_LOADING:
            beats.set()
    sock.send_multipart([identity, encode(Shutdown())])


def test_heartbeats_continue_while_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beats = threading.Event()
    heard: list[bool] = []

    def slow_setup(self: WorkerDaemon, setup: WorkerSetup) -> WorkerHello:
        # A checkpoint that takes a while to load: until the scheduler got heartbeats.
        heard.append(beats.wait(DAEMON_SAFETY_S))
        return WorkerHello(
            rank=self.rank,
            pid=0,
            device="cpu",
            num_gpu_blocks=8,
            kv_bytes_per_block=1,
            block_size=setup.settings.scheduler.block_size,
            model="slow",
        )

    monkeypatch.setattr(WorkerDaemon, "_setup", slow_setup)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/workers.sock"
    sock.bind(endpoint)
    seen: list[str] = []
    scheduler = threading.Thread(target=_fake_scheduler, args=(sock, seen, beats))
    scheduler.start()
    try:
        assert WorkerDaemon(0, endpoint, "cpu").run() == 0  # left on the Shutdown
    finally:
        scheduler.join(20)
        sock.close(linger=0)
        ctx.term()
    assert heard == [True], "no heartbeats reached the scheduler while the model loaded"
    assert seen[0] == WorkerJoin.__name__ and seen[-1] == WorkerHello.__name__
    between = seen[1:-1]
    assert len(between) >= BEATS_WHILE_LOADING and set(between) == {"Heartbeat"}, seen
