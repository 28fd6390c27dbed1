"""The native backend: CPU attention in C (``kernels/paged_attention_cpu.c``, built once
per machine by :mod:`gpu_worker.kernels.native_build`) for float32 and bfloat16 models,
int8 caches too; docs/architecture.md ("Attention") has its design. Sequences of more
than :data:`PROMPT_ROWS` query rows attend through the torch backend's groups, except in
a soft-capped layer; the plan makes that split once per step, and checks every index the
kernel will follow (it trusts them).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gpu_worker.attention import AttentionBackend, StepArrays, StepMetadata
from gpu_worker.attention.torch_backend import (
    Caches,
    Group,
    attend_group,
    plan_groups,
    store_index,
    store_layer,
)
from gpu_worker.kernels.attention_args import AttentionParams
from gpu_worker.kernels.native_build import Library, library
from gpu_worker.kernels.warmup import CacheLayout

MAX_HEAD_DIM = 256
"""The kernel's limit (``MAX_HEAD_DIM`` in the source)."""
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
"""The kernel's dtypes and its entry points' suffixes."""
FEATURES = ((1, "avx2"), (2, "avx512"), (4, "avx512_bf16"), (8, "openmp"))
"""What the build targets (``expeditor_kernel_features()``'s bits; none: SSE vectors)."""
PROMPT_ROWS = 16
"""Sequences with more query rows attend through SDPA, the rest through the kernel."""


class NativeKernels:
    """The compiled library's attention (with the K/V store) for one dtype."""

    def __init__(self, lib: Library, dtype: torch.dtype = torch.float32) -> None:
        self.path, self.dtype, cdll = lib.path, dtype, lib.cdll
        self._attend = getattr(cdll, f"expeditor_paged_attention_{SUFFIXES[dtype]}")
        # q, k, v with their strides, slots, caches, scales, out, tables, sequences, shape
        types = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float}
        self._attend.argtypes = [types[c] for c in "piipiipiipippippipiipipppiiiiifif"]
        bits = cdll.expeditor_kernel_features()
        self.features = tuple(name for bit, name in FEATURES if bits & bit)
        self.threads = cdll.expeditor_kernel_threads
        """The threads a call may use now (torch's; 1 without OpenMP)."""

    def attend(
        self,
        q: Tensor,
        kv: tuple[Tensor, Tensor] | None,
        caches: Caches,
        step: NativeStep,
        out: Tensor,
        p: AttentionParams,
        scales: Caches | None = None,
    ) -> None:
        """Store the new rows ``kv`` in their slots (None: stored already), then attend
        ``step``'s sequences into their rows of ``out``: those of at most
        :data:`PROMPT_ROWS` query rows, or all in a soft-capped layer. ``scales``: an
        int8 cache's (``caches`` then hold its codes)."""
        seqs = step.all_seqs if p.softcap else step.kernel_seqs
        new = (*_rows(kv[0]), *_rows(kv[1])) if kv else (0,) * 6
        new += (step.slots.data_ptr(), len(step.slots))
        cache = (*_pair(caches), *((0, 0, 0) if scales is None else _pair(scales)))
        tables = (step.tables.data_ptr(), step.tables.stride(0), step.lens.data_ptr())
        shape = (seqs.data_ptr(), len(seqs), q.shape[1], *caches[0].shape[1:])
        args = (*_rows(q), *new, *cache, *_rows(out), *tables, step.starts.data_ptr(), *shape)
        if self._attend(*args, p.scale, p.window, p.softcap):
            raise ValueError("native attention refused the shapes")


def _rows(t: Tensor) -> tuple[int, int, int]:
    """A [tokens, heads, head_dim] tensor for the kernel: its address and first strides."""
    return t.data_ptr(), t.stride(0), t.stride(1)


def _pair(caches: Caches) -> tuple[int, int, int]:
    """A layer's (keys, values) for the kernel: their addresses and block stride."""
    return caches[0].data_ptr(), caches[1].data_ptr(), caches[0].stride(0)


@functools.cache
def _loaded(dtype: torch.dtype = torch.float32) -> NativeKernels | str:
    loaded = library()
    return loaded if isinstance(loaded, str) else NativeKernels(loaded, dtype)


def load(
    device: torch.device, layout: CacheLayout, num_heads: int
) -> tuple[NativeKernels | None, str]:
    """This process's kernels for the layout, or None and why not."""
    if device.type != "cpu" or layout.dtype not in SUFFIXES:
        return None, f"{layout.dtype} on {device.type} (the kernel: float32, bfloat16 on a CPU)"
    if layout.kv_dtype not in (None, torch.int8):
        return None, f"a {layout.kv_dtype} KV cache (the kernel reads int8 codes, no fp8)"
    if layout.head_dim > MAX_HEAD_DIM:
        return None, f"head_dim {layout.head_dim} beyond the kernel's {MAX_HEAD_DIM}"
    kernels = _loaded(layout.dtype)
    return (None, kernels) if isinstance(kernels, str) else (kernels, "")


@dataclass(slots=True)
class NativeStep:
    """A step's indices as the kernel reads them, and its split."""

    tables: Tensor
    lens: Tensor
    starts: Tensor
    slots: Tensor
    """int32 ``block_tables``, ``seq_lens``, ``query_start_loc``; int64 ``slot_mapping``."""
    all_seqs: Tensor
    """Every sequence with query rows (a soft-capped layer's kernel call)."""
    kernel_seqs: Tensor
    """Those with at most :data:`PROMPT_ROWS` rows; the others: ``groups`` (torch's)."""
    groups: list[Group]
    covered: bool
    """Every token is a sequence's query row."""
    store: tuple[tuple[Tensor, Tensor], Tensor | None] | None
    """Where an int8 cache's new codes and scales go (``store_index``); None: no int8."""
    caches_checked: bool = False
    """The first layer found its caches as the kernel reads them (all are views of one)."""


def check_step(arrays: StepArrays, num_blocks: int, block_size: int) -> None:
    """Raise ``ValueError`` unless every index the kernel follows is inside the cache and
    the step: query rows increasing within the tokens, each sequence's rows at most its
    keys, its blocks in its table and in the cache, each slot in the cache."""
    starts, lens = (np.asarray(arrays[n], dtype=np.int64) for n in ("query_start_loc", "seq_lens"))
    tables, slots = np.asarray(arrays["block_tables"]), np.asarray(arrays["slot_mapping"])
    q_lens = np.diff(starts)
    if starts.shape != (len(lens) + 1,) or tables.ndim != 2 or len(tables) != len(lens):
        raise ValueError("query_start_loc, seq_lens and block_tables disagree on the sequences")
    if starts.size and (starts[0] < 0 or starts[-1] > slots.shape[0] or (q_lens < 0).any()):
        raise ValueError(f"query_start_loc {starts.tolist()} outside the step's tokens")
    if (q_lens > lens).any():
        raise ValueError("a sequence has more query rows than keys")
    if lens.size and int(lens.max()) > tables.shape[1] * block_size:
        raise ValueError(f"a sequence of {int(lens.max())} keys beyond its block table")
    blocks = tables[np.arange(tables.shape[1]) < -(-lens[:, None] // block_size)]
    if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"block ids outside the cache's {num_blocks} blocks")
    if slots.size and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(f"a slot outside the cache's {num_blocks * block_size} slots")


class NativeBackend(AttentionBackend):
    name = "native"

    def __init__(
        self, layout: CacheLayout, num_heads: int, device: torch.device, kernels: NativeKernels
    ) -> None:
        super().__init__(layout, num_heads, device)
        self.kernels = kernels

    def plan(self, arrays: StepArrays, num_blocks: int, *, capture: bool = False) -> NativeStep:
        block_size = self.layout.block_size
        check_step(arrays, num_blocks, block_size)
        tables, lens, starts = (
            torch.from_numpy(np.ascontiguousarray(arrays[n], dtype=np.int32))
            for n in ("block_tables", "seq_lens", "query_start_loc")
        )
        slots = torch.from_numpy(np.ascontiguousarray(arrays["slot_mapping"], dtype=np.int64))
        q_lens = np.diff(starts.numpy())
        kv_row = self.layout.num_kv_heads * self.layout.head_dim
        long = np.flatnonzero(q_lens > PROMPT_ROWS)
        groups = plan_groups(arrays, block_size, kv_row, self.device, long)
        some = q_lens > 0
        seqs = [torch.from_numpy(np.flatnonzero(s)) for s in (some, some & (q_lens <= PROMPT_ROWS))]
        covered = len(starts) > 0 and int(starts[0]) == 0 and int(starts[-1]) == len(slots)
        store = store_index(arrays, block_size, self.device) if self.layout.kv_dtype else None
        return NativeStep(tables, lens, starts, slots, *seqs, groups, covered, store)

    def forward(
        self, meta: StepMetadata, layer: int, q: Tensor, k: Tensor, v: Tensor, p: AttentionParams
    ) -> Tensor:
        step: NativeStep = meta.plan
        caches = meta.layer_caches[layer]
        scales = None if meta.layer_scales is None else meta.layer_scales[layer]
        dtype, tokens = self.kernels.dtype, step.slots.shape[0]
        rows = (q, k, v) if scales is None else (q,)  # K/V the kernel stores
        if not all(t.dtype == dtype and t.stride(2) == 1 and len(t) == tokens for t in rows):
            raise ValueError(f"native attention takes {dtype} rows of the step's tokens")
        if not step.caches_checked:
            check_caches(caches, scales, dtype)
            step.caches_checked = True
        if scales is not None:  # codes and scales, stored as the torch backend stores them
            assert step.store is not None
            k, v = store_layer(caches, scales, *step.store, k, v, dtype)
        out = torch.empty_like(q) if step.covered else torch.zeros_like(q)
        self.kernels.attend(q, (k, v) if scales is None else None, caches, step, out, p, scales)
        for g in () if p.softcap else step.groups:
            attend_group(g, out, q, k, v, caches, p, scales)
        return out


def check_caches(caches: Caches, scales: Caches | None, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless a layer's caches are as the kernel reads them: ``dtype``
    (int8 codes with float16 ``scales``), the two alike, contiguous within a block."""
    (keys, values), code = caches, dtype if scales is None else torch.int8
    pairs = [(keys, values, code, (keys.shape[2] * keys.shape[3], keys.shape[3], 1))]
    if scales is not None:
        pairs.append((*scales, torch.float16, (scales[0].shape[2], 1)))
    for a, b, kind, rows in pairs:
        if not (a.dtype == b.dtype == kind and a.stride() == b.stride() and a.stride()[1:] == rows):
            raise ValueError(f"native attention takes {kind} caches, contiguous in a block")
