"""The KV cache's size on CUDA: what is left of total * utilization after the profile's
peak (weights, a full-budget forward, the sampler at max_num_seqs rows), memory outside
torch (other processes included) and the swap staging buffer (CUDA's memory calls are
faked: the profile run itself runs on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.kv_cache import SWAP_STAGING_BYTES, KVLayout, swap_staging_blocks
from gpu_worker.memory_budget import MemoryProfile, describe, kv_cache_blocks
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampler import Sampler
from shared.worker_settings import WorkerSettings

GIB = 2**30


def test_everything_beside_the_cache_is_subtracted() -> None:
    profile = MemoryProfile(
        total=80 * GIB, free=60 * GIB, torch_reserved=16 * GIB, torch_peak=20 * GIB
    )
    assert profile.outside_torch == 4 * GIB  # 80 - 60 free - 16 torch
    blocks = kv_cache_blocks(profile, 0.9, reserved=GIB, bytes_per_block=2**20)
    assert blocks == (72 - 20 - 4 - 1) * 1024
    # Another process taking 10 GiB more leaves 10 GiB less for the cache.
    crowded = MemoryProfile(
        total=80 * GIB, free=50 * GIB, torch_reserved=16 * GIB, torch_peak=20 * GIB
    )
    assert kv_cache_blocks(crowded, 0.9, GIB, 2**20) == blocks - 10 * 1024
    # No room: not positive, and the figures say why.
    full = MemoryProfile(total=80 * GIB, free=GIB, torch_reserved=70 * GIB, torch_peak=71 * GIB)
    assert kv_cache_blocks(full, 0.9, GIB, 2**20) < 1
    assert "torch peak 71.00 GiB" in describe(full, 0.9, GIB)


def test_swap_staging_is_a_fixed_size() -> None:
    big = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert big.bytes_per_block == 2 * GIB // 1024  # 2 MiB
    assert swap_staging_blocks(big) == SWAP_STAGING_BYTES // big.bytes_per_block == 64
    huge = KVLayout(
        num_layers=200, num_kv_heads=64, head_dim=256, block_size=64, dtype=torch.float32
    )
    assert swap_staging_blocks(huge) == 1  # at least one block


@pytest.fixture
def fake_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """CUDA's memory queries answering fixed figures; the sampler's calls recorded."""
    calls: dict[str, Any] = {"sampled": []}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (13 * GIB, 16 * GIB))
    sample = Sampler.sample

    def recording(self: Sampler, logits: torch.Tensor, params: Any, *rest: Any) -> Any:
        calls["sampled"].append((tuple(logits.shape), params[0]))
        return sample(self, logits, params, *rest)

    monkeypatch.setattr(Sampler, "sample", recording)
    return calls


def test_the_profile_covers_the_sampler_and_the_staging(
    model: Path, fake_cuda_memory: dict[str, Any]
) -> None:
    runner = ModelRunner(
        WorkerSettings.of(
            model=str(model), block_size=16, max_num_batched_tokens=64, num_gpu_blocks=8
        ),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    blocks = runner._profile_num_blocks(64, max_num_seqs=48, utilization=0.5)
    # The sampler ran over max_num_seqs rows of the full vocabulary, in its heaviest
    # mode (top-p sorts, seeded draws, logprobs, every logits control).
    ((shape, params),) = fake_cuda_memory["sampled"]
    assert shape == (48, runner.vocab_size)
    assert params.top_p < 1 and params.seed is not None and params.logprobs
    assert params.penalised and params.logit_bias and params.allowed_token_ids and params.min_p
    profile = runner.memory_profile
    assert profile == MemoryProfile(
        total=16 * GIB, free=13 * GIB, torch_reserved=2 * GIB, torch_peak=3 * GIB
    )
    staging = swap_staging_blocks(runner.layout) * runner.layout.bytes_per_block
    expected = (8 * GIB - 3 * GIB - GIB - staging) // runner.layout.bytes_per_block
    assert blocks == expected
