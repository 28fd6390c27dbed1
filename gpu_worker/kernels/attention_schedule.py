"""A step's attention schedule: which kernel launch takes which sequence, computed once per
step on the host and shared by every layer.

:func:`plan_attention` splits a step's sequences, from the host arrays the model runner
already has (``query_start_loc``, ``seq_lens``), into three kinds of work:

* **decode tiles**: sequences with at most a decode tile's tokens (decodes), BLOCK_M 16
  rows of (token, GQA query head);
* **prefill tiles**: longer chunks, BLOCK_M 64 rows, so a chunk's K/V is read once per
  64 rows rather than once per 16 whatever else shares the step;
* **split-KV decodes** (flash-decoding): decodes whose one program per KV head would
  keep the GPU waiting on them: a context longer than an SM's fair share of all the
  decodes' key reads (their sum times the KV heads over ``num_sms``; so when the
  decodes' programs underfill the GPU, or one context dwarfs the others), spanning at
  least :data:`SPLIT_MIN_PARTITIONS` partitions of ``partition_size`` keys. Each
  partition is a program writing a partial (max, sum, accumulator) in float32; a reduce
  program per (sequence, KV head) merges them exactly (log-sum-exp). With a sliding
  window, only the partitions the window reaches work.

Each tile launch is over its own sequences only: an index array of them and a prefix
array of their first tiles (partitions for the split), in which a program finds its
sequence by binary search. These device index tensors are views of one int32 buffer
sent in one copy (from pinned memory with ``non_blocking=True`` on CUDA: no host sync),
each view 16-byte aligned. The kernels read the lengths themselves from the caller's
``seq_lens`` and ``query_start_loc`` tensors, so a schedule depends on the step's
structure only (which sequence is a decode, a chunk or a split decode, and how many
tiles or partitions each has): one planned for a padded decode bucket serves every
replay of a CUDA graph captured with it, as long as it has no split decodes (plan it
with ``num_sms=0``).

Compiled variants: :func:`kernel_constexprs` is the only source of the kernels'
compile-time constants, and it depends on the kind of launch and the model (head layout,
dtype, window and softcap flags), never on the batch: at most :data:`KINDS` (4) compiled
attention kernels per model layer kind. Every batch-dependent int is a runtime argument
that the kernels do not specialise on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

DECODE_ROWS = 16
"""Rows (query token x GQA query head) of a decode tile: tl.dot's smallest M."""
PREFILL_ROWS = 64
"""Rows of a prefill tile."""
SPLIT_PARTITION = 512
"""Keys per split-KV partition (a runtime argument of the kernels: any multiple of
:data:`PARTITION_MULTIPLE` compiles to the same variant)."""
SPLIT_MIN_PARTITIONS = 4
"""A decode is split only when its context spans at least this many partitions."""
PARTITION_MULTIPLE = 32
"""Partition sizes are multiples of this (every key tile's size divides it)."""
_ALIGN = 4
"""Each device index tensor starts at a multiple of this many int32 (16 bytes)."""
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton runs its interpreter (read once: Triton reads it at import too)."""

DECODE, PREFILL, SPLIT, REDUCE = "decode", "prefill", "split", "reduce"
KINDS = (DECODE, PREFILL, SPLIT, REDUCE)
"""The kinds of attention launch, one compiled kernel variant each per layer kind."""
NUM_WARPS = {DECODE: 4, PREFILL: 8, SPLIT: 4, REDUCE: 4}
"""Warps per program of each kind (part of the compiled variant too). A prefill tile's
64 x head_dim float32 accumulator takes 8: with 4 it spills on sm_90 at head_dim 256
(bf16) or 128 (float32)."""


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class TileConfig:
    """A tile of BLOCK_M rows: BLOCK_Q query tokens x QPK_PAD query heads of a KV head."""

    qpk_pad: int
    block_q: int
    block_m: int


def tile_config(kind: str, queries_per_kv: int) -> TileConfig:
    """The tile of ``kind`` (:data:`DECODE` or :data:`PREFILL`, the main kernel's two;
    :data:`SPLIT` partitions tile one token's heads like :data:`DECODE`)."""
    qpk_pad = _next_power_of_2(queries_per_kv)
    block_m = max(PREFILL_ROWS if kind == PREFILL else DECODE_ROWS, qpk_pad)
    return TileConfig(qpk_pad, block_m // qpk_pad, block_m)


def key_tile(head_dim: int) -> int:
    """Keys per online-softmax step (TILE_N)."""
    return 32 if _dim_pad(head_dim) <= 128 else 16


def _dim_pad(head_dim: int) -> int:
    return max(16, _next_power_of_2(head_dim))


def kernel_constexprs(
    kind: str,
    *,
    queries_per_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    has_window: bool,
    has_softcap: bool,
    quantized: bool = False,
) -> dict[str, int | bool]:
    """The compile-time constants of a launch of ``kind``: from the model only
    (``quantized``: its cache holds 8-bit codes and scales)."""
    interpreter_loop = INTERPRET
    dim_pad = _dim_pad(head_dim)
    if kind == REDUCE:
        return {
            "QUERIES_PER_KV": queries_per_kv,
            "QPK_PAD": _next_power_of_2(queries_per_kv),
            "DIM_PAD": dim_pad,
            "HAS_WINDOW": has_window,
            "INTERPRETER_LOOP": interpreter_loop,
        }
    config = tile_config(kind, queries_per_kv)
    shared: dict[str, int | bool] = {
        "QUERIES_PER_KV": queries_per_kv,
        "BLOCK_M": config.block_m,
        "TILE_N": key_tile(head_dim),
        "DIM_PAD": dim_pad,
        "BLOCK_SIZE": block_size,
        "IEEE_DOT": dtype == torch.float32,
        "HAS_WINDOW": has_window,
        "HAS_SOFTCAP": has_softcap,
        "INTERPRETER_LOOP": interpreter_loop,
        "QUANT": quantized,
    }
    if kind == SPLIT:
        return shared
    if kind not in (DECODE, PREFILL):
        raise ValueError(f"unknown attention launch kind {kind!r}")
    return {**shared, "QPK_PAD": config.qpk_pad, "BLOCK_Q": config.block_q}


@dataclass(frozen=True, slots=True)
class TileLaunch:
    """One launch of the main kernel: grid (num_tiles, num_kv_heads)."""

    kind: str
    config: TileConfig
    seqs: torch.Tensor
    """[num_seqs] int32: the launch's sequences (indices into the step's)."""
    tile_start: torch.Tensor
    """[num_seqs + 1] int32: the first tile of each, and the total."""
    num_seqs: int
    num_tiles: int


@dataclass(frozen=True, slots=True)
class SplitLaunch:
    """The split-KV decodes: partial grid (num_parts, num_kv_heads), reduce grid
    (num_seqs, num_kv_heads)."""

    seqs: torch.Tensor
    """[num_seqs] int32: the split sequences."""
    part_start: torch.Tensor
    """[num_seqs + 1] int32: the first partition of each, and the total."""
    num_seqs: int
    num_parts: int
    partition_size: int
    max_logits: torch.Tensor
    """[num_parts, num_heads] float32 workspace: each partition's running max..."""
    sums: torch.Tensor
    """... its softmax denominator ([num_parts, num_heads] float32) ..."""
    partials: torch.Tensor
    """... and its unnormalised output ([num_parts, num_heads, head_dim] float32)."""


@dataclass(frozen=True, slots=True)
class AttentionSchedule:
    """A step's attention launches (see the module docstring); reused by every layer."""

    num_kv_heads: int
    queries_per_kv: int
    head_dim: int
    block_size: int
    num_seqs: int
    num_tokens: int
    """``query_start_loc[-1]``: query rows up to here belong to sequences."""
    decode: TileLaunch | None
    prefill: TileLaunch | None
    split: SplitLaunch | None
    decode_seqs: np.ndarray
    """Host copies of the classification: sequences per launch, and per split sequence
    its partition count."""
    prefill_seqs: np.ndarray
    split_seqs: np.ndarray
    split_parts: np.ndarray
    host_buffer: torch.Tensor
    """The (pinned, on CUDA) host buffer of the device index tensors, kept alive with
    the schedule while its copy may be in flight."""

    @property
    def kinds(self) -> list[str]:
        """The kinds of launch the schedule makes, in order."""
        kinds = [launch.kind for launch in (self.decode, self.prefill) if launch is not None]
        return [*kinds, SPLIT, REDUCE] if self.split is not None else kinds


@functools.lru_cache(maxsize=8)
def _device_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def split_decodes(
    q_lens: np.ndarray,
    seq_lens: np.ndarray,
    *,
    num_kv_heads: int,
    num_sms: int,
    partition_size: int = SPLIT_PARTITION,
) -> np.ndarray:
    """Which sequences take the split-KV path (bool per sequence): decodes (one query
    token) whose context spans at least :data:`SPLIT_MIN_PARTITIONS` partitions and is
    longer than an SM's fair share of all decodes' key reads (their total times
    ``num_kv_heads`` over ``num_sms``): one program per KV head would leave the GPU
    underfilled while it runs. ``num_sms`` 0: none."""
    decode = (q_lens == 1) & (seq_lens > 0)
    if num_sms <= 0 or not decode.any():
        return np.zeros(len(q_lens), dtype=bool)
    fair_share = float(seq_lens[decode].sum()) * num_kv_heads / num_sms
    long_enough = _cdiv(seq_lens, partition_size) >= SPLIT_MIN_PARTITIONS
    return decode & long_enough & (seq_lens > fair_share)


def plan_attention(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    *,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    block_size: int,
    num_sms: int | None,
    device: torch.device | str,
    partition_size: int = SPLIT_PARTITION,
) -> AttentionSchedule:
    """The schedule of a step from host arrays: ``query_start_loc`` [num_seqs + 1] and
    ``seq_lens`` [num_seqs] (context lengths including the step's tokens), as given to
    :func:`~gpu_worker.kernels.paged_attention.paged_attention_triton`. ``num_sms``: the GPU's
    multiprocessors, which decide the split-KV decodes (None: the CUDA device's own,
    none elsewhere; 0: no split). Never waits for the device."""
    device = torch.device(device)
    starts = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if starts.shape != (len(lens) + 1,):
        raise ValueError(f"query_start_loc must be [{len(lens) + 1}], got {starts.shape}")
    if partition_size <= 0 or partition_size % PARTITION_MULTIPLE:
        raise ValueError(f"partition_size must be a multiple of {PARTITION_MULTIPLE}")
    if num_sms is None:
        num_sms = _device_sms(device) if device.type == "cuda" else 0
    q_lens = starts[1:] - starts[:-1]
    split = split_decodes(
        q_lens, lens, num_kv_heads=num_kv_heads, num_sms=num_sms, partition_size=partition_size
    )
    decode_cfg = tile_config(DECODE, queries_per_kv)
    active = (q_lens > 0) & ~split
    decode_seqs = np.flatnonzero(active & (q_lens <= decode_cfg.block_q))
    prefill_seqs = np.flatnonzero(active & (q_lens > decode_cfg.block_q))
    split_seqs = np.flatnonzero(split)
    split_parts = _cdiv(lens[split_seqs], partition_size)

    configs = {DECODE: decode_cfg, PREFILL: tile_config(PREFILL, queries_per_kv)}
    counts = {
        DECODE: _cdiv(q_lens[decode_seqs], configs[DECODE].block_q),
        PREFILL: _cdiv(q_lens[prefill_seqs], configs[PREFILL].block_q),
    }
    members = {DECODE: decode_seqs, PREFILL: prefill_seqs, SPLIT: split_seqs}
    segments = []
    for kind in (DECODE, PREFILL, SPLIT):
        per_seq = split_parts if kind == SPLIT else counts[kind]
        segments += [members[kind], np.concatenate([[0], np.cumsum(per_seq)])]
    host, views = _to_device(segments, device)

    launches: dict[str, TileLaunch | None] = {}
    for i, kind in enumerate((DECODE, PREFILL)):
        n = len(members[kind])
        launches[kind] = (
            TileLaunch(
                kind, configs[kind], views[2 * i], views[2 * i + 1], n, int(counts[kind].sum())
            )
            if n
            else None
        )
    split_launch = None
    if len(split_seqs):
        num_parts = int(split_parts.sum())
        num_heads = num_kv_heads * queries_per_kv
        f32 = {"dtype": torch.float32, "device": device}
        split_launch = SplitLaunch(
            seqs=views[4],
            part_start=views[5],
            num_seqs=len(split_seqs),
            num_parts=num_parts,
            partition_size=partition_size,
            max_logits=torch.empty(num_parts, num_heads, **f32),
            sums=torch.empty(num_parts, num_heads, **f32),
            partials=torch.empty(num_parts, num_heads, head_dim, **f32),
        )
    return AttentionSchedule(
        num_kv_heads=num_kv_heads,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        block_size=block_size,
        num_seqs=len(lens),
        num_tokens=int(starts[-1]),
        decode=launches[DECODE],
        prefill=launches[PREFILL],
        split=split_launch,
        decode_seqs=decode_seqs,
        prefill_seqs=prefill_seqs,
        split_seqs=split_seqs,
        split_parts=split_parts,
        host_buffer=host,
    )


def _to_device(
    segments: list[np.ndarray], device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The segments as int32 views of one device buffer, each at a 16-byte boundary,
    sent in one copy (pinned and non-blocking on CUDA), and the host buffer."""
    offsets, size = [], 0
    for segment in segments:
        offsets.append(size)
        size += -(-max(len(segment), 1) // _ALIGN) * _ALIGN
    raw = np.zeros(size, dtype=np.int32)
    for segment, offset in zip(segments, offsets, strict=True):
        raw[offset : offset + len(segment)] = segment
    host = torch.from_numpy(raw)
    if device.type == "cuda":
        host = torch.empty(size, dtype=torch.int32, pin_memory=True).copy_(host)
    buffer = host if device.type == "cpu" else host.to(device, non_blocking=True)
    views = [
        buffer[offset : offset + len(segment)]
        for segment, offset in zip(segments, offsets, strict=True)
    ]
    return host, views


__all__ = [
    "DECODE",
    "KINDS",
    "NUM_WARPS",
    "PREFILL",
    "REDUCE",
    "SPLIT",
    "SPLIT_MIN_PARTITIONS",
    "SPLIT_PARTITION",
    "AttentionSchedule",
    "SplitLaunch",
    "TileConfig",
    "TileLaunch",
    "kernel_constexprs",
    "key_tile",
    "plan_attention",
    "split_decodes",
    "tile_config",
]
