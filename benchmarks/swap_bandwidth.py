"""Swap bandwidth of the worker's KV cache against a plain memcpy of the same bytes.

Swaps a batch of scattered blocks out to the shared-memory pool and back in, and
copies the same number of bytes with one contiguous ``copy_`` (the memcpy baseline),
in the same run. On CUDA the baseline is a pinned host <-> device copy.

    .venv/bin/python benchmarks/swap_bandwidth.py [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from gpu_worker.kv_cache import KVCache, KVLayout
from shared.swap_pool import SwapPoolSegment

SHAPES = {
    # 8B-class GQA model: 32 layers, 8 KV heads of 128, bf16, block 16 -> 2 MiB blocks.
    "8b-block": (KVLayout(32, 8, 128, 16, torch.bfloat16), 512, 256),
    # The embedded tiny model: 2 layers, 2 KV heads of 16, fp32, block 16 -> 8 KiB blocks.
    "tiny-block": (KVLayout(2, 2, 16, 16, torch.float32), 65536, 32768),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """Median of ``repeat`` timed runs after two untimed warm-up runs."""
    times = []
    for attempt in range(repeat + 2):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        if attempt >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(name: str, device: torch.device, repeat: int, scattered: bool) -> dict:
    layout, num_blocks, batch = SHAPES[name]
    rng = random.Random(0)
    with SwapPoolSegment.create(num_blocks, layout.bytes_per_block) as segment:
        cache = KVCache(layout, num_blocks, device, segment)
        # Touch every page first: first-touch page faults are not bandwidth.
        cache.kv.fill_(1)
        assert cache.cpu_pool is not None
        cache.cpu_pool.fill_(2)
        gpu_ids = rng.sample(range(num_blocks), batch)
        # Pool blocks as a fresh CpuBlockPool hands them out: one run. "--scattered"
        # draws them at random instead (a fragmented pool).
        cpu_ids = rng.sample(range(num_blocks), batch) if scattered else list(range(batch))
        out_pairs = list(zip(gpu_ids, cpu_ids, strict=True))
        in_pairs = list(zip(cpu_ids, gpu_ids, strict=True))
        nbytes = batch * layout.bytes_per_block
        swap_out = _median_time(lambda: cache.swap_out(out_pairs), repeat, device)
        swap_in = _median_time(lambda: cache.swap_in(in_pairs), repeat, device)
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(2)
        memcpy_out = _median_time(lambda: host.copy_(src, non_blocking=True), repeat, device)
        memcpy_in = _median_time(lambda: src.copy_(host, non_blocking=True), repeat, device)
        cache.detach_swap_pool()
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    return {
        "shape": name,
        "pool_ids": "scattered" if scattered else "contiguous",
        "device": str(device),
        "blocks": batch,
        "bytes_per_block": layout.bytes_per_block,
        "swap_out_gbps": gbps(swap_out),
        "swap_in_gbps": gbps(swap_in),
        "memcpy_out_gbps": gbps(memcpy_out),
        "memcpy_in_gbps": gbps(memcpy_in),
        "ratio_out": memcpy_out / swap_out,
        "ratio_in": memcpy_in / swap_in,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--scattered", action="store_true", help="random pool block ids")
    args = parser.parse_args()
    device = torch.device(args.device)
    results = [measure(name, device, args.repeat, args.scattered) for name in SHAPES]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'shape':11} {'blocks':>6} {'block':>9} {'out GB/s':>9} {'memcpy':>7} {'ratio':>6}"
        f" {'in GB/s':>8} {'memcpy':>7} {'ratio':>6}"
    )
    for r in results:
        print(
            f"{r['shape']:11} {r['blocks']:6d} {r['bytes_per_block']:9d} "
            f"{r['swap_out_gbps']:9.2f} {r['memcpy_out_gbps']:7.2f} {r['ratio_out']:6.2f} "
            f"{r['swap_in_gbps']:8.2f} {r['memcpy_in_gbps']:7.2f} {r['ratio_in']:6.2f}"
        )


if __name__ == "__main__":
    main()
