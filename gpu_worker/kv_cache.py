"""The device KV cache and its view of the CPU swap pool.

Layout: one device tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (2 = key, value), so a block, all layers of it, is one contiguous run of
``bytes_per_block`` bytes. The swap pool (a shared-memory segment) is viewed with the
same per-block shape, ``[num_cpu_blocks, num_layers, 2, ...]``: swapping a block is one
contiguous copy, and a batch of them is a device-side gather or scatter plus copies of
contiguous runs between device and host. A quantized cache (``kv_dtype``,
:mod:`gpu_worker.kv_quant`) stores each block as bytes: its 8-bit codes, then their
float16 scales, viewed as ``[num_blocks, num_layers, 2, ...]`` codes and
``[num_blocks, num_layers, 2, block_size, num_kv_heads]`` scales.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.kernels import copy_blocks, scatter_blocks
from gpu_worker.kv_quant import SCALE_DTYPE
from gpu_worker.staging import Staging
from shared.swap_pool import SwapPoolSegment


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """A cache laid out in layer groups (a model mixing windowed and full-attention
    layers; :mod:`scheduler_svc.core.kv_groups` has the design): every group the same
    number of layers, a block holding one group's, a table every group's side by side."""

    windows: tuple[int, ...]
    """Per group, the keys its layers read back from a query (0: the whole context)."""
    where: tuple[tuple[int, int], ...]
    """Per model layer, its (group, slot in the group's blocks)."""

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """Per model layer, its group."""
        return tuple(group for group, _ in self.where)


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    """Layers a block holds: the model's, or with ``groups`` a group's."""
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    """The model's dtype (queries, outputs; the K/V too unless ``kv_dtype``)."""
    kv_dtype: torch.dtype | None = None
    """The K/V codes' 8-bit dtype of a quantized cache (None: K/V in ``dtype``)."""
    groups: LayerGroups | None = None
    """The cache's layer groups, if it is laid out in groups."""

    @property
    def layer_slots(self) -> list[int]:
        """Per model layer, where in a block its K/V are."""
        if self.groups is None:
            return list(range(self.num_layers))
        return [slot for _, slot in self.groups.where]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """A block's K/V values (codes when quantized)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """A quantized block's scales: one per row of ``head_dim`` codes."""
        return self.block_shape[:-1]

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """A block as stored: its values, or a quantized block's bytes."""
        return self.block_shape if self.kv_dtype is None else (self.bytes_per_block,)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else torch.uint8

    @property
    def code_bytes(self) -> int:
        """Bytes of a block's K/V values (codes when quantized)."""
        return _numel(self.block_shape) * (self.kv_dtype or self.dtype).itemsize

    @property
    def bytes_per_block(self) -> int:
        if self.kv_dtype is None:
            return self.code_bytes
        return self.code_bytes + _numel(self.scale_shape) * SCALE_DTYPE.itemsize

    def views(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``storage`` [n, *storage_shape] as (values [n, *block_shape], scales [n,
        *scale_shape] or None when not quantized)."""
        if self.kv_dtype is None:
            return storage, None
        n, cut = storage.shape[0], self.code_bytes
        codes = storage[:, :cut].view(self.kv_dtype).view(n, *self.block_shape)
        scales = storage[:, cut:].view(SCALE_DTYPE).view(n, *self.scale_shape)
        return codes, scales


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


SWAP_STAGING_BYTES = 128 * 2**20
"""Device memory a CUDA cache holds to stage swaps through (gathered blocks on their way
to the pool, pool blocks on their way in): allocated with the pool, counted in the
memory budget, and swaps larger than it go through in chunks."""


def swap_staging_blocks(layout: KVLayout) -> int:
    """Blocks the swap staging buffer holds (at least one)."""
    return max(1, SWAP_STAGING_BYTES // layout.bytes_per_block)


SMALL_BLOCK_BYTES = 256 * 1024
"""On CPU, blocks below this size are swapped by one batched gather + scatter through a
staging buffer; larger ones by one copy per contiguous run (per-call overhead is then
negligible and a single pass beats two)."""


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce (src, dst) block pairs into (src_start, dst_start, length) runs."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _side_runs(table: torch.Tensor, side: int) -> tuple[torch.Tensor, list[int]]:
    """Pairs [n, 2] sorted by ``side`` (0: source, 1: destination), and the row offsets
    where runs of consecutive ids on that side start (with n appended)."""
    ordered = table[torch.argsort(table[:, side])]
    keys = ordered[:, side]
    breaks = (torch.nonzero(keys[1:] != keys[:-1] + 1).flatten() + 1).tolist()
    return ordered, [0, *breaks, len(table)]


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device,
        swap_pool: SwapPoolSegment | None = None,
        staging: Staging | None = None,
    ) -> None:
        """``staging``: the worker's transfers, which send the block ids of swaps and
        copies to the device without blocking the host."""
        self.layout = layout
        self.staging = staging or Staging(device)
        self.num_blocks = num_blocks
        self.device = device
        self.kv = torch.zeros(
            (num_blocks, *layout.storage_shape), dtype=layout.storage_dtype, device=device
        )
        """The blocks as stored (what swap and copy-on-write move)."""
        values, scales = layout.views(self.kv)
        layers = layout.layer_slots
        self.layer_caches = [(values[:, layer, 0], values[:, layer, 1]) for layer in layers]
        """Per model layer: (key, value) [blocks, block_size, kv_heads, head_dim] (codes
        when quantized)."""
        self.layer_scales = (
            None
            if scales is None
            else [(scales[:, layer, 0], scales[:, layer, 1]) for layer in layers]
        )
        """Per layer of a quantized cache: (key, value) scales [blocks, block_size,
        kv_heads]; None otherwise."""
        self.cpu_pool: torch.Tensor | None = None
        self._swap_staging: torch.Tensor | None = None
        self._pinned = False
        self._staging = torch.empty(0, dtype=layout.storage_dtype)
        if swap_pool is not None:
            self.attach_swap_pool(swap_pool)

    def attach_swap_pool(self, segment: SwapPoolSegment, rank: int = 0, ranks: int = 1) -> None:
        """Map the segment. A tensor-parallel group shares one: rank r of N owns the r-th
        of N equal contiguous parts (its KV heads of every pool block)."""
        bpb = self.layout.bytes_per_block
        num_cpu_blocks = segment.size // (bpb * ranks)
        raw = torch.frombuffer(
            segment.buf,
            dtype=torch.uint8,
            count=num_cpu_blocks * bpb,
            offset=rank * num_cpu_blocks * bpb,
        )
        layout = self.layout
        self.cpu_pool = raw.view(layout.storage_dtype).view(num_cpu_blocks, *layout.storage_shape)
        if self.device.type == "cuda":
            # Pin the mapped pages so device<->host copies run as DMA.
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.cpu_pool.data_ptr(), raw.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the swap pool failed ({err})")
            self._pinned = True
        if self.device.type != "cpu" and self._swap_staging is None:
            self._swap_staging = self._new_swap_staging()

    def _new_swap_staging(self) -> torch.Tensor:
        return torch.empty(
            (swap_staging_blocks(self.layout), *self.layout.storage_shape),
            dtype=self.layout.storage_dtype,
            device=self.device,
        )

    def fence(self) -> None:
        """Wait for this cache's copies in flight (swap-ins read the pool asynchronously):
        after it the scheduler may reuse the pool blocks they read. Nothing off CUDA,
        where copies are done when they return."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def detach_swap_pool(self) -> None:
        """Drop every view of the segment (it can then be closed), after the copies that
        read or write it."""
        if self.cpu_pool is not None and self._pinned:
            self.fence()
            torch.cuda.cudart().cudaHostUnregister(self.cpu_pool.data_ptr())
        self.cpu_pool = None
        self._pinned = False

    @property
    def num_cpu_blocks(self) -> int:
        return 0 if self.cpu_pool is None else self.cpu_pool.shape[0]

    def _pool(self) -> torch.Tensor:
        if self.cpu_pool is None:
            raise RuntimeError("plan swaps blocks but no swap pool is attached")
        return self.cpu_pool

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to pool blocks: (device block, pool block) pairs."""
        if not pairs:
            return
        pool = self._pool()
        if self.device.type == "cpu":
            self._cpu_copy(self.kv, pool, pairs)
            return
        self._device_swap_out(pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy pool blocks to device blocks: (pool block, device block) pairs."""
        if not pairs:
            return
        pool = self._pool()
        if self.device.type == "cpu":
            self._cpu_copy(pool, self.kv, pairs)
            return
        self._device_swap_in(pairs)

    def _chunks(self, ordered: list[tuple[int, int]]) -> tuple[torch.Tensor, list[list]]:
        if self._swap_staging is None:
            self._swap_staging = self._new_swap_staging()
        size = self._swap_staging.shape[0]
        return self._swap_staging, [ordered[i : i + size] for i in range(0, len(ordered), size)]

    def _device_swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device blocks gathered into the staging buffer, then copied to the pool in
        runs of consecutive pool blocks; a chunk at a time. Waits for the copies (the
        scheduler reads the pool blocks once the step is reported)."""
        pool = self._pool()
        staging, chunks = self._chunks(sorted(pairs, key=lambda p: p[1]))
        for chunk in chunks:
            staged = staging[: len(chunk)]
            torch.index_select(self.kv, 0, self._ids([g for g, _ in chunk]), out=staged)
            for src, dst, n in _runs([(i, c) for i, (_, c) in enumerate(chunk)]):
                pool[dst : dst + n].copy_(staged[src : src + n], non_blocking=True)
        self.fence()

    def _device_swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Pool blocks copied into the staging buffer in runs, then scattered to their
        device blocks; a chunk at a time (the stream orders a chunk's copies after the
        previous chunk's scatter, which read the same buffer)."""
        pool = self._pool()
        staging, chunks = self._chunks(sorted(pairs))
        for chunk in chunks:
            staged = staging[: len(chunk)]
            for src, dst, n in _runs([(c, i) for i, (c, _) in enumerate(chunk)]):
                staged[dst : dst + n].copy_(pool[src : src + n], non_blocking=True)
            scatter_blocks(staged, self.kv, self._ids([g for _, g in chunk]))

    def _cpu_copy(
        self, src: torch.Tensor, dst: torch.Tensor, pairs: Sequence[tuple[int, int]]
    ) -> None:
        """Block copies on the host, in one pass wherever a side is contiguous."""
        if self.layout.bytes_per_block >= SMALL_BLOCK_BYTES:
            for s, d, n in _runs(pairs):
                dst[d : d + n].copy_(src[s : s + n])
            return
        rows = self.kv[0].numel()
        src_flat = src.view(src.shape[0], rows)
        dst_flat = dst.view(dst.shape[0], rows)
        table = torch.tensor(pairs, dtype=torch.int64)
        few = len(pairs) // 8 + 1
        for side in (1, 0):
            ordered, starts = _side_runs(table, side)
            if len(starts) - 1 > few:
                continue
            for a, b in itertools.pairwise(starts):
                first = int(ordered[a, side])
                other = ordered[a:b, 1 - side]
                if side == 1:  # contiguous destinations: gather straight in
                    torch.index_select(src_flat, 0, other, out=dst_flat[first : first + b - a])
                else:  # contiguous sources: scatter straight out
                    dst_flat.index_copy_(0, other, src_flat[first : first + b - a])
            return
        if self._staging.numel() < len(pairs) * rows:
            self._staging = torch.empty(len(pairs) * rows, dtype=self.layout.storage_dtype)
        staged = self._staging[: len(pairs) * rows].view(len(pairs), rows)
        torch.index_select(src_flat, 0, table[:, 0], out=staged)
        dst_flat.index_copy_(0, table[:, 1], staged)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: (source device block, destination device block) pairs."""
        if pairs:
            copy_blocks(self.kv, self._ids(pairs))

    def _ids(self, ids: Sequence[int] | Sequence[tuple[int, int]]) -> torch.Tensor:
        """Block ids as an int64 device tensor, sent without blocking the host."""
        return self.staging.to_device({"ids": np.asarray(ids, dtype=np.int64)})["ids"]
