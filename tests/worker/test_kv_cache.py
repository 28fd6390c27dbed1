"""The worker's KV cache: swap through the shared-memory pool, copy-on-write."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_worker.kv_cache import KVCache, KVLayout
from shared.swap_pool import SwapPoolSegment

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
LARGE = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, block_size=32, dtype=torch.float16)
SMALL_INT8 = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32, kv_dtype=torch.int8
)
LARGE_FP8 = KVLayout(
    num_layers=4, num_kv_heads=8, head_dim=64, block_size=32, dtype=torch.bfloat16,
    kv_dtype=torch.float8_e4m3fn,
)  # fmt: skip
LAYOUTS = {"small-blocks": SMALL, "large-blocks": LARGE, "small-int8": SMALL_INT8}
LAYOUTS["large-fp8"] = LARGE_FP8


def filled(layout: KVLayout, num_blocks: int, segment: SwapPoolSegment) -> KVCache:
    cache = KVCache(layout, num_blocks, torch.device("cpu"), segment)
    g = torch.Generator().manual_seed(0)
    if layout.kv_dtype is None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    else:  # a quantized cache's bytes: codes and scales alike
        cache.kv.copy_(torch.randint(0, 256, cache.kv.shape, generator=g, dtype=torch.uint8))
    return cache


PAIRINGS = {
    "contiguous-pool": lambda gpu: list(zip(gpu, range(len(gpu)), strict=True)),
    "contiguous-device": lambda gpu: list(zip(range(len(gpu)), gpu, strict=True)),
    "scattered": lambda gpu: list(
        zip(gpu, random.Random(1).sample(range(40), len(gpu)), strict=True)
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_swap_out_then_in_restores_every_byte(layout: KVLayout, pairing: str) -> None:
    with SwapPoolSegment.create(40, layout.bytes_per_block) as segment:
        cache = filled(layout, 32, segment)
        original = cache.kv.clone()
        device_blocks = random.Random(0).sample(range(32), 12)
        out_pairs = PAIRINGS[pairing](device_blocks)
        cache.swap_out(out_pairs)
        assert cache.cpu_pool is not None
        for dev, cpu in out_pairs:
            assert torch.equal(cache.cpu_pool[cpu], original[dev])
        cache.kv[[d for d, _ in out_pairs]] = 0  # the blocks get reused meanwhile
        targets = random.Random(2).sample(range(32), 12)
        in_pairs = [(cpu, target) for (_, cpu), target in zip(out_pairs, targets, strict=True)]
        cache.swap_in(in_pairs)
        for (dev, _), target in zip(out_pairs, targets, strict=True):
            assert torch.equal(cache.kv[target], original[dev])
        cache.detach_swap_pool()


@pytest.mark.parametrize("staging_blocks", [1, 5, 64], ids=["1-block", "5-blocks", "all"])
@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_the_device_path_swaps_through_a_fixed_staging_buffer(
    monkeypatch: pytest.MonkeyPatch, staging_blocks: int, pairing: str
) -> None:
    """The CUDA path (gather into the staging buffer, runs to the pool; runs from the
    pool into it, scatter), run here on CPU tensors: swaps larger than the buffer go
    through in chunks, and every byte arrives."""
    monkeypatch.setattr(
        "gpu_worker.kv_cache.SWAP_STAGING_BYTES", staging_blocks * SMALL.bytes_per_block
    )
    with SwapPoolSegment.create(40, SMALL.bytes_per_block) as segment:
        cache = filled(SMALL, 32, segment)
        original = cache.kv.clone()
        out_pairs = PAIRINGS[pairing](random.Random(3).sample(range(32), 12))
        cache._device_swap_out(out_pairs)
        assert cache._swap_staging is not None
        assert cache._swap_staging.shape[0] == min(staging_blocks, 64)
        assert cache.cpu_pool is not None
        for dev, cpu in out_pairs:
            assert torch.equal(cache.cpu_pool[cpu], original[dev])
        cache.kv.zero_()
        targets = random.Random(4).sample(range(32), 12)
        in_pairs = [(cpu, t) for (_, cpu), t in zip(out_pairs, targets, strict=True)]
        cache._device_swap_in(in_pairs)
        for (dev, _), target in zip(out_pairs, targets, strict=True):
            assert torch.equal(cache.kv[target], original[dev])
        untouched = sorted(set(range(32)) - set(targets))
        assert not cache.kv[untouched].any()
        cache.detach_swap_pool()


def test_a_second_mapping_sees_the_swapped_bytes() -> None:
    """Swapped KV lives in the segment, not in the worker: a new worker maps it back."""
    with SwapPoolSegment.create(8, SMALL.bytes_per_block) as segment:
        first = filled(SMALL, 8, segment)
        first.swap_out([(3, 5)])
        block = first.kv[3].clone()
        first.detach_swap_pool()
        attached = SwapPoolSegment.attach(segment.name)
        second = KVCache(SMALL, 8, torch.device("cpu"), attached)
        second.swap_in([(5, 0)])
        assert torch.equal(second.kv[0], block)
        second.detach_swap_pool()
        attached.close()


def test_copy_blocks_and_layer_views() -> None:
    cache = KVCache(SMALL, 6, torch.device("cpu"))
    cache.kv.copy_(torch.arange(cache.kv.numel(), dtype=torch.float32).view(cache.kv.shape))
    before = cache.kv.clone()
    cache.copy([(1, 4), (2, 5)])
    assert torch.equal(cache.kv[4], before[1]) and torch.equal(cache.kv[5], before[2])
    assert torch.equal(cache.kv[:4], before[:4])
    key, value = cache.layer_caches[1]
    assert key.shape == (6, 4, 2, 4) and torch.equal(key[2], cache.kv[2, 1, 0])
    assert value.data_ptr() == cache.kv[:, 1, 1].data_ptr()


def test_swap_without_a_pool_is_an_error() -> None:
    cache = KVCache(SMALL, 4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="no swap pool"):
        cache.swap_out([(0, 0)])


def test_segment_lifecycle() -> None:
    segment = SwapPoolSegment.create(4, 1024)
    assert segment.size >= 4096
    name = segment.name
    attached = SwapPoolSegment.attach(name)
    attached.buf[0] = 7
    assert segment.buf[0] == 7
    attached.close()  # an attached mapping never removes the segment
    again = SwapPoolSegment.attach(name)
    assert again.buf[0] == 7
    again.close()
    segment.close()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SwapPoolSegment.attach(name)
    with pytest.raises(ValueError, match="bytes_per_block"):
        SwapPoolSegment.create(4, 0)


def test_a_step_that_only_swaps_in_fences_its_copies(model: Path) -> None:
    """A step that samples nothing returns without waiting for the device: its swap-ins
    must be fenced first, or the scheduler reuses pool blocks still being read (CUDA).
    Counted on CPU, where the fence itself is a no-op."""
    import torch

    from gpu_worker.model_runner import ModelRunner
    from ipc.schema import BatchPlan
    from shared.swap_pool import SwapPoolSegment
    from shared.worker_settings import WorkerSettings

    settings = WorkerSettings.of(
        model=str(model), block_size=16, max_num_batched_tokens=64, num_gpu_blocks=8
    )
    runner = ModelRunner(settings, device=torch.device("cpu"))
    fences: list[int] = []
    runner.kv_cache.fence = lambda: fences.append(1)  # type: ignore[method-assign]
    with SwapPoolSegment.create(4, runner.layout.bytes_per_block) as pool:
        runner.kv_cache.attach_swap_pool(pool)
        runner.execute(BatchPlan(step=1, num_scheduled_tokens={}, swap_in=[(0, 3)]))
        assert fences == [1]
        runner.execute(BatchPlan(step=2, num_scheduled_tokens={}, swap_out=[(3, 1)]))
        assert fences == [1]  # a swap-out is waited for inside swap_out itself
        runner.kv_cache.detach_swap_pool()
