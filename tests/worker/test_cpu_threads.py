"""The CPU worker's thread count: set, or chosen by timing its own decode forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker import threads
from gpu_worker.model_runner import ModelRunner
from shared.worker_settings import WorkerSettings


@pytest.fixture(scope="module")
def runner(model: Path) -> ModelRunner:
    settings = WorkerSettings.of(
        model=str(model), block_size=16, max_num_batched_tokens=256, num_gpu_blocks=64
    )
    return ModelRunner(settings, device=torch.device("cpu"))


def test_decode_inputs_fit_the_cache(runner: ModelRunner) -> None:
    inputs = threads.decode_inputs(runner)
    blocks = [b for table in inputs.tables for b in table]
    assert len(blocks) == len(set(blocks)) and max(blocks) < runner.num_gpu_blocks
    assert len(inputs.token_ids) == len(inputs.starts) == len(inputs.tables) > 1
    for start, table in zip(inputs.starts, inputs.tables, strict=True):
        assert start < len(table) * runner.block_size  # the new token's slot exists
    hidden = runner.forward_only(inputs)
    assert hidden.shape[0] == len(inputs.token_ids) and torch.isfinite(hidden).all()


@pytest.mark.parametrize(
    ("spare_ms", "all_ms", "chosen"),
    [(10.0, 5.0, 4), (10.0, 9.0, 3), (10.0, 8.5, 4), (10.0, 8.8, 3)],
)
def test_every_core_only_when_clearly_faster(
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    spare_ms: float,
    all_ms: float,
    chosen: int,
) -> None:
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads, "_cpu_seconds", lambda: None)  # no quiet check
    timed = {3: spare_ms / 1e3, 4: all_ms / 1e3}
    calls: list[int] = []
    monkeypatch.setattr(threads, "time_forward", lambda r, i, n: calls.append(n) or timed[n])
    before = torch.get_num_threads()
    try:
        assert threads.choose_cpu_threads(runner) == chosen
        assert torch.get_num_threads() == chosen
        assert calls[:4] == [3, 4, 3, 4]  # the counts take turns
        calls.clear()
        assert threads.choose_cpu_threads(runner, configured=2) == 2
        assert torch.get_num_threads() == 2 and calls == []  # set: no timing
    finally:
        torch.set_num_threads(before)


def test_a_measurement_taken_while_others_were_busy_is_repeated(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other processes' CPU time during the timing (here a full core, then none) makes
    the worker time again; the quiet measurement decides."""
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    rounds = iter([{1: 0.010, 2: 0.012}, {1: 0.010, 2: 0.005}])  # contended, then quiet
    monkeypatch.setattr(threads, "fastest_forwards", lambda r, i, c: next(rounds))
    readings = iter([(0.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0)])  # 1 s of others, 0
    monkeypatch.setattr(threads, "_cpu_seconds", lambda: next(readings))
    monkeypatch.setattr(threads, "_others_cores", lambda b, a, w: a[0] - b[0] - (a[1] - b[1]))
    before = torch.get_num_threads()
    try:
        assert threads.choose_cpu_threads(runner) == 2  # 2x faster once quiet
    finally:
        torch.set_num_threads(before)


def test_others_cores_subtracts_this_process() -> None:
    assert threads._others_cores((10.0, 1.0), (12.0, 2.0), 2.0) == pytest.approx(0.5)
    assert threads._others_cores((10.0, 1.0), (10.5, 2.0), 1.0) == 0.0  # never negative
    assert threads._others_cores(None, (1.0, 1.0), 1.0) is None
    reading = threads._cpu_seconds()
    assert reading is None or (reading[0] >= 0 and reading[1] >= 0)
