"""The CPU worker's thread count: set, or chosen by timing its own decode forward."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import threads
from gpu_worker.model_runner import ModelRunner
from gpu_worker.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model = make_tiny_model(tmp_path_factory.mktemp("threads") / "m", arch="llama")
    return ModelRunner(
        str(model),
        device=torch.device("cpu"),
        block_size=16,
        max_num_batched_tokens=256,
        num_gpu_blocks=64,
    )


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
    ("spare_ms", "all_ms", "chosen"), [(10.0, 5.0, 4), (10.0, 9.0, 3), (10.0, 7.5, 3)]
)
def test_every_core_only_when_clearly_faster(
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    spare_ms: float,
    all_ms: float,
    chosen: int,
) -> None:
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
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
