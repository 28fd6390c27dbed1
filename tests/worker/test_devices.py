"""Which GPU a worker rank runs on, with the CUDA calls faked (no GPU here)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model_runner import resolve_device, use_device


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(device))
    return current


def test_each_rank_takes_its_own_gpu(four_gpus: list[torch.device]) -> None:
    assert [resolve_device("cuda", rank) for rank in range(6)] == [
        torch.device("cuda", i) for i in (0, 1, 2, 3, 0, 1)
    ]
    assert resolve_device("auto", 2) == torch.device("cuda", 2)
    assert resolve_device("cuda:3", 0) == torch.device("cuda", 3)  # an index given is kept
    with pytest.raises(ValueError, match="only 4 CUDA device"):
        resolve_device("cuda:4", 0)


def test_one_visible_gpu_per_rank_is_device_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd gives rank i CUDA_VISIBLE_DEVICES=i: it sees one GPU, its own."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda", 3) == torch.device("cuda", 0)


def test_the_step_thread_is_put_on_the_workers_device(four_gpus: list[torch.device]) -> None:
    use_device(torch.device("cuda", 2))
    use_device(torch.device("cpu"))  # nothing to do off CUDA
    assert four_gpus == [torch.device("cuda", 2)]


def test_cpu_and_missing_cuda() -> None:
    assert resolve_device("cpu", 5) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda", 0)
        assert resolve_device("auto", 1) == torch.device("cpu")
