"""Fair share reaches HTTP users (issue 29, item 7), end to end through ``expeditor serve
--http``: the gateway is one client of the scheduler, yet a user who queued a large
backlog does not hold up another user's request, and a user's unfinished requests are
capped (429 naming ``max_queued_per_user``). Users are told apart by their address
(no API key): the two users here connect from 127.0.0.2 and 127.0.0.3."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from support.http import post_json
from support.idle import wait_idle
from support.limits import SERVE_SAFETY_S
from support.serve import running_http_serve

from ipc.client import Client

HEAVY_BATCHES = 4
BATCH = 32
CAP = 2 * HEAVY_BATCHES * BATCH


def _post(url: str, source: str, body: dict) -> tuple[int, dict]:
    """A completion request sent from the address ``source`` (the user it stands for)."""
    return post_json(url, "/v1/completions", body, timeout=SERVE_SAFETY_S, source=source)


def _waiting(frontend: str) -> int:
    with Client(frontend, timeout=30) as client:
        snapshot = client.inspect().snapshot
        assert snapshot is not None
        return snapshot.num_waiting


def test_one_http_users_backlog_does_not_hold_up_another(model: Path) -> None:
    flags = ("--max-num-seqs", "4", "--num-gpu-blocks", "512")
    flags += ("--max-queued-per-user", str(CAP))
    with running_http_serve(model, *flags) as (frontend, url, _):
        heavy_body = {"prompt": [[1, 7, 9]] * BATCH, "max_tokens": 48, "ignore_eos": True}
        heavy_replies: list[int] = []
        heavy = [
            threading.Thread(
                target=lambda: heavy_replies.append(_post(url, "127.0.0.2", heavy_body)[0])
            )
            for _ in range(HEAVY_BATCHES)
        ]
        for thread in heavy:
            thread.start()
        with Client(frontend, timeout=30) as client:
            while (client.inspect().snapshot.num_waiting or 0) < HEAVY_BATCHES * BATCH - 8:  # type: ignore[union-attr]
                time.sleep(0.01)
        status, light = _post(url, "127.0.0.3", {"prompt": [1, 5], "max_tokens": 4})
        still_waiting = _waiting(frontend)
        # Past the cap: the heavy user's next batch is refused as a whole, by name.
        over = {"prompt": [[1, 7]] * (CAP // 2 + 8), "max_tokens": 2}
        refused, error = _post(url, "127.0.0.2", over)
        for thread in heavy:
            thread.join(SERVE_SAFETY_S)
        wait_idle(frontend)
    assert status == 200 and light["choices"][0]["finish_reason"] == "length"
    # Served while most of the heavy user's backlog still waited (first come, first
    # served, it would have waited for all of it: nothing of it left waiting).
    assert still_waiting >= HEAVY_BATCHES * BATCH // 2, still_waiting
    assert heavy_replies == [200] * HEAVY_BATCHES
    assert refused == 429, error
    assert "max_queued_per_user" in error["error"]["message"]
