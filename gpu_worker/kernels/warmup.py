"""Start-up warm-up of the attention kernels: compile every variant a model will use before
the first served step needs it (each costs 0.5-2 s the first time, a stall mid-serving).

The variants depend only on the model (head layout, head_dim, block size, dtype, the
window and softcap flags of each kind of layer; see
:func:`~gpu_worker.kernels.attention_schedule.kernel_constexprs`), so one tiny batch per
kind of layer, scheduled to hold a decode tile, a prefill tile and a split-KV decode,
compiles them all. The cache views it reads have the served cache's strides (the same
per-block layout, one block): Triton specialises on some of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from gpu_worker.kernels.attention_schedule import (
    DECODE,
    PARTITION_MULTIPLE,
    SPLIT_MIN_PARTITIONS,
    plan_attention,
    tile_config,
)
from gpu_worker.kernels.paged_attention import paged_attention_triton


class CacheLayout(Protocol):
    """What the warm-up needs of the KV cache's layout (``kv_cache.KVLayout`` has it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype | None


def warm_up(
    layout: CacheLayout,
    *,
    num_heads: int,
    device: torch.device | str,
    layer_kinds: Iterable[tuple[int | None, float | None]] = ((None, None),),
) -> list[tuple[str, bool, bool]]:
    """Launch each attention configuration once on tiny inputs: per distinct (window,
    softcap) of ``layer_kinds`` (None: none; only whether each is set matters), the
    decode tile, the prefill tile, the split-KV partial and its reduce, with
    ``num_heads`` query heads (this rank's) over ``layout``. Returns the (kind,
    has_window, has_softcap) launched, after the device has run them (the Triton
    backend's warm-up).
    """
    device = torch.device(device)
    kv_heads, head_dim, block_size = layout.num_kv_heads, layout.head_dim, layout.block_size
    queries_per_kv = num_heads // kv_heads
    # A chunk one token longer than a decode tile, a short decode, and a decode long
    # enough to split into SPLIT_MIN_PARTITIONS small partitions on a "GPU" so large that
    # every such decode underfills it.
    chunk = tile_config(DECODE, queries_per_kv).block_q + 1
    long_context = SPLIT_MIN_PARTITIONS * PARTITION_MULTIPLE
    q_lens = np.array([chunk, 1, 1])
    seq_lens = np.array([chunk, 2, long_context])
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    schedule = plan_attention(
        starts,
        seq_lens,
        num_kv_heads=kv_heads,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        block_size=block_size,
        num_sms=1 << 20,
        device=device,
        partition_size=PARTITION_MULTIPLE,
    )
    # One block of the cache's per-block layout; every table entry points at it.
    kv_shape = (1, layout.num_layers, 2, block_size, kv_heads, head_dim)
    kv_cache = torch.zeros(kv_shape, dtype=layout.kv_dtype or layout.dtype, device=device)
    scale_cache = torch.ones(kv_shape[:-1], dtype=torch.float16, device=device)
    scales = None if layout.kv_dtype is None else (scale_cache[:, 0, 0], scale_cache[:, 0, 1])
    width = -(-long_context // block_size)
    tables = torch.zeros((len(q_lens), width), dtype=torch.int32, device=device)
    query = torch.zeros((int(starts[-1]), num_heads, head_dim), dtype=layout.dtype, device=device)
    lens_t = torch.from_numpy(seq_lens.astype(np.int32)).to(device)
    starts_t = torch.from_numpy(starts.astype(np.int32)).to(device)
    flags: dict[tuple[bool, bool], tuple[int | None, float | None]] = {}
    for window, softcap in layer_kinds:
        flags.setdefault((bool(window), softcap is not None), (window, softcap))
    launched: list[tuple[str, bool, bool]] = []
    for (has_window, has_softcap), (window, softcap) in flags.items():
        paged_attention_triton(
            query,
            kv_cache[:, 0, 0],
            kv_cache[:, 0, 1],
            tables,
            lens_t,
            starts_t,
            head_dim**-0.5,
            window=window,
            softcap=softcap,
            schedule=schedule,
            scales=scales,
        )
        launched += [(kind, has_window, has_softcap) for kind in schedule.kinds]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return launched


__all__ = ["CacheLayout", "warm_up"]
