"""``expeditor serve`` on a checkpoint that takes longer to load than the scheduler's
``worker_timeout_s`` (5 s) -- here 16 s, slowed by a ``sitecustomize`` that delays
``from_pretrained`` in the worker process and notes which process it slowed -- is
served by the worker that loaded it: never taken for lost, never replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipc.client import Client
from ipc.schema import WorkerStatus
from scheduler_svc.launch import running_server

LOAD_S = 16.0

SLOW_LOAD = """
import os
import time

import transformers

_original = transformers.AutoModelForCausalLM.from_pretrained.__func__


def _slowed(cls, *args, **kwargs):
    with open(os.environ["SLOW_LOAD_LOG"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(float(os.environ["SLOW_LOAD_S"]))
    return _original(cls, *args, **kwargs)


transformers.AutoModelForCausalLM.from_pretrained = classmethod(_slowed)
"""


def test_a_checkpoint_slower_to_load_than_the_worker_timeout_is_served(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_LOAD)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{Path.cwd()}")
    log = tmp_path / "slowed.log"
    monkeypatch.setenv("SLOW_LOAD_LOG", str(log))
    monkeypatch.setenv("SLOW_LOAD_S", str(LOAD_S))
    with running_server(model, "--worker-timeout-s", "5", timeout_s=120) as (address, _):
        with Client(address, timeout=120) as client:
            done = client.generate(prompt_token_ids=[1, 5, 9], max_tokens=4, temperature=0.0)
            assert len(done.token_ids) == 4
            workers = client.inspect().workers
    # One load, slowed, in the process that then served: no worker was replaced.
    slowed = [int(pid) for pid in log.read_text().split()]
    assert [w.state for w in workers] == [WorkerStatus.READY]
    assert slowed == [workers[0].pid]
