"""Split-KV (flash-decoding) attention for long-context decodes.

One decode's attention over a long context is one program per KV head in the main kernel:
a single 32k-token sequence would keep 8 programs busy on a GPU with 132
multiprocessors. Here its context is cut into partitions of ``partition_size`` keys (a
runtime argument); a program per (partition, KV head) attends its query heads to the
partition's keys and writes a partial result in float32: the running max ``m``, the
softmax denominator ``l`` and the unnormalised output ``acc``. A reduce program per
(sequence, KV head) then merges them exactly: with ``M = max m_p``, the output is
``sum(acc_p * exp(m_p - M)) / sum(l_p * exp(m_p - M))``.

With a sliding window, partitions are counted from the one holding the window's first
key: only as many have work as the window reaches (the others exit at once, and the
reduce reads only those with work). Softcap applies per score as in the main kernel.
The schedule (:mod:`gpu_worker.kernels.attention_schedule`) decides which decodes split.
"""

# Triton kernel parameters stay unannotated: Triton reads annotations for specialisation.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from gpu_worker.kernels.attention_args import Scales, scale_args
from gpu_worker.kernels.attention_schedule import NUM_WARPS, REDUCE, SPLIT, kernel_constexprs
from gpu_worker.kernels.attention_tile import attend_key_range, find_slot

if TYPE_CHECKING:
    from gpu_worker.kernels.attention_schedule import AttentionSchedule, SplitLaunch


@triton.jit
def _first_partition_key(seq_len, window, partition_size, HAS_WINDOW: tl.constexpr):
    # The first key of a sequence's first partition with work: 0, or with a window the
    # start of the partition holding the decode's earliest visible key.
    base = seq_len * 0
    if HAS_WINDOW:
        base = tl.maximum(seq_len - window, 0) // partition_size * partition_size
    return base


@triton.jit(
    do_not_specialize=[
        "query_ptr",
        "block_tables_ptr",
        "seq_lens_ptr",
        "query_start_loc_ptr",
        "window",
        "num_split_seqs",
        "partition_size",
        "q_s0",
        "q_s1",
        "bt_s0",
    ]
)
def _split_kv_partial_kernel(
    max_ptr,
    sum_ptr,
    acc_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    split_seqs_ptr,
    part_start_ptr,
    scale,
    window,
    softcap,
    num_split_seqs,
    partition_size,
    num_heads,
    head_dim,
    q_s0,
    q_s1,
    q_s2,
    kc_s0,
    kc_s1,
    kc_s2,
    kc_s3,
    vc_s0,
    vc_s1,
    vc_s2,
    vc_s3,
    key_scale_ptr,
    value_scale_ptr,
    ks_s0,
    ks_s1,
    ks_s2,
    bt_s0,
    bt_s1,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    INTERPRETER_LOOP: tl.constexpr,
    QUANT: tl.constexpr,
):
    # One program per (partition of a split decode, kv head); rows are the kv head's
    # query heads (padded to BLOCK_M for tl.dot). The i-th split sequence owns the
    # partitions [part_start[i], part_start[i + 1]).
    part = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = find_slot(part_start_ptr, part, num_split_seqs)
    seq = tl.load(split_seqs_ptr + slot)
    index = part - tl.load(part_start_ptr + slot)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = _first_partition_key(seq_len, window, partition_size, HAS_WINDOW)
    start += index * partition_size
    if start >= seq_len:
        return  # past the window's partitions: no work (and the reduce reads nothing)
    end = tl.minimum(start + partition_size, seq_len)
    min_key = 0
    if HAS_WINDOW:
        min_key = tl.maximum(seq_len - window, 0)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < head_dim
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q = tl.load(
        query_ptr + q_row * q_s0 + head[:, None] * q_s1 + dims[None, :] * q_s2,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_s0
    m_i, l_i, acc = attend_key_range(
        start, min_key, end, q, q_pos, row_ok, m_i, l_i, acc, table, bt_s1,
        key_cache_ptr, value_cache_ptr, kc_s0, kc_s1, kc_s2, kc_s3,
        vc_s0, vc_s1, vc_s2, vc_s3, key_scale_ptr, value_scale_ptr, ks_s0, ks_s1, ks_s2,
        kv_head, dims, dim_ok, scale, window, softcap,
        TILE_N, BLOCK_SIZE, IEEE_DOT, HAS_WINDOW, HAS_SOFTCAP, QUANT, INTERPRETER_LOOP,
    )  # fmt: skip

    ws_row = part.to(tl.int64) * num_heads + head
    tl.store(max_ptr + ws_row, m_i, mask=row_ok)
    tl.store(sum_ptr + ws_row, l_i, mask=row_ok)
    tl.store(
        acc_ptr + ws_row[:, None] * head_dim + dims[None, :],
        acc,
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _merge_partition(
    p, first, num_heads, head_dim, head, dims, ok, dim_ok, m_i, l_i, acc, max_ptr, sum_ptr, acc_ptr
):
    ws_row = (first + p).to(tl.int64) * num_heads + head
    m_p = tl.load(max_ptr + ws_row, mask=ok, other=float("-inf"))
    l_p = tl.load(sum_ptr + ws_row, mask=ok, other=0.0)
    acc_p = tl.load(
        acc_ptr + ws_row[:, None] * head_dim + dims[None, :],
        mask=ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m_new = tl.maximum(m_i, m_p)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_shift)
    beta = tl.exp(m_p - m_shift)
    return m_new, l_i * alpha + l_p * beta, acc * alpha[:, None] + acc_p * beta[:, None]


@triton.jit(
    do_not_specialize=[
        "seq_lens_ptr",
        "query_start_loc_ptr",
        "window",
        "partition_size",
        "o_s0",
        "o_s1",
    ]
)
def _split_kv_reduce_kernel(
    out_ptr,
    max_ptr,
    sum_ptr,
    acc_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    split_seqs_ptr,
    part_start_ptr,
    window,
    partition_size,
    num_heads,
    head_dim,
    o_s0,
    o_s1,
    o_s2,
    QUERIES_PER_KV: tl.constexpr,
    QPK_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INTERPRETER_LOOP: tl.constexpr,
):
    # One program per (split sequence, kv head): merges the partitions with work.
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(split_seqs_ptr + slot)
    first = tl.load(part_start_ptr + slot)
    allocated = tl.load(part_start_ptr + slot + 1) - first
    seq_len = tl.load(seq_lens_ptr + seq)
    base = _first_partition_key(seq_len, window, partition_size, HAS_WINDOW)
    num_work = tl.minimum(allocated, (seq_len - base + partition_size - 1) // partition_size)

    rows = tl.arange(0, QPK_PAD)
    ok = rows < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < head_dim
    m_i = tl.full([QPK_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QPK_PAD], dtype=tl.float32)
    acc = tl.zeros([QPK_PAD, DIM_PAD], dtype=tl.float32)
    if INTERPRETER_LOOP:
        p = 0
        while p < num_work:
            m_i, l_i, acc = _merge_partition(
                p, first, num_heads, head_dim, head, dims, ok, dim_ok, m_i, l_i, acc,
                max_ptr, sum_ptr, acc_ptr,
            )  # fmt: skip
            p += 1
    else:
        for p in range(0, num_work):
            m_i, l_i, acc = _merge_partition(
                p, first, num_heads, head_dim, head, dims, ok, dim_ok, m_i, l_i, acc,
                max_ptr, sum_ptr, acc_ptr,
            )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + q_row * o_s0 + head[:, None] * o_s1 + dims[None, :] * o_s2,
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=ok[:, None] & dim_ok[None, :],
    )


def split_kv_decode(
    launch: SplitLaunch,
    schedule: AttentionSchedule,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    scales: Scales | None = None,
) -> None:
    """Attention of the schedule's split decodes into their rows of ``out``: the partial
    launch, then the reduce (``window`` / ``softcap`` 0 for none)."""
    layout = {
        "queries_per_kv": schedule.queries_per_kv,
        "head_dim": schedule.head_dim,
        "block_size": schedule.block_size,
        "dtype": query.dtype,
        "has_window": window > 0,
        "has_softcap": softcap > 0,
    }
    num_heads = query.shape[1]
    _split_kv_partial_kernel[(launch.num_parts, schedule.num_kv_heads)](
        launch.max_logits,
        launch.sums,
        launch.partials,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        launch.seqs,
        launch.part_start,
        float(scale),
        window,
        softcap if softcap else 1.0,
        launch.num_seqs,
        launch.partition_size,
        num_heads,
        schedule.head_dim,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *scale_args(key_cache, scales),
        *block_tables.stride(),
        **kernel_constexprs(SPLIT, **layout, quantized=scales is not None),
        num_warps=NUM_WARPS[SPLIT],
    )
    _split_kv_reduce_kernel[(launch.num_seqs, schedule.num_kv_heads)](
        out,
        launch.max_logits,
        launch.sums,
        launch.partials,
        seq_lens,
        query_start_loc,
        launch.seqs,
        launch.part_start,
        window,
        launch.partition_size,
        num_heads,
        schedule.head_dim,
        *out.stride(),
        **kernel_constexprs(REDUCE, **layout),
        num_warps=NUM_WARPS[REDUCE],
    )


__all__ = ["split_kv_decode"]
