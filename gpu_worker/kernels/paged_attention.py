"""Paged attention over mixed batches of prefill chunks and decodes (causal, GQA, with an
optional sliding window and attention-logit soft-capping).

A step's :class:`~gpu_worker.kernels.attention_schedule.AttentionSchedule` says which
launch takes which sequence: decode tiles and prefill tiles of the main kernel here, and
split-KV decodes (:mod:`gpu_worker.kernels.split_kv`) for long contexts that would
underfill the GPU. The reference is the torch backend
(:mod:`gpu_worker.attention.torch_backend`); the Triton backend
(:mod:`gpu_worker.attention.triton_backend`) calls these kernels.
"""

# Triton kernel parameters stay unannotated: Triton reads annotations for specialisation.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels.attention_args import Scales, check_args, scale_args
from gpu_worker.kernels.attention_schedule import (
    NUM_WARPS,
    AttentionSchedule,
    TileLaunch,
    kernel_constexprs,
    plan_attention,
)
from gpu_worker.kernels.attention_tile import attend_key_range, find_slot
from gpu_worker.kernels.split_kv import split_kv_decode


@triton.jit(
    do_not_specialize=[
        "query_ptr",
        "block_tables_ptr",
        "seq_lens_ptr",
        "query_start_loc_ptr",
        "window",
        "num_launch_seqs",
        "q_s0",
        "q_s1",
        "o_s0",
        "o_s1",
        "bt_s0",
    ]
)
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    launch_seqs_ptr,
    tile_start_ptr,
    scale,
    window,
    softcap,
    num_launch_seqs,
    head_dim,
    q_s0,
    q_s1,
    q_s2,
    o_s0,
    o_s1,
    o_s2,
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
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
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
    # One program per (query tile of one of the launch's sequences, kv head). A tile holds
    # BLOCK_Q query tokens x the QUERIES_PER_KV query heads sharing this kv head, as
    # BLOCK_M rows (row r -> token r // QPK_PAD, head r % QPK_PAD), so every K/V tile
    # loaded is used by the whole GQA group. The launch's i-th sequence owns the tiles
    # [tile_start[i], tile_start[i + 1]).
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = find_slot(tile_start_ptr, tile, num_launch_seqs)
    seq = tl.load(launch_seqs_ptr + slot)
    local_tile = tile - tl.load(tile_start_ptr + slot)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    tile_q0 = local_tile * BLOCK_Q
    if tile_q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # absolute position of this chunk's first query token

    rows = tl.arange(0, BLOCK_M)
    row_tok = rows // QPK_PAD
    head_in_group = rows % QPK_PAD
    q_tok = tile_q0 + row_tok  # token index within this sequence's chunk
    head = kv_head * QUERIES_PER_KV + head_in_group
    row_ok = (row_tok < BLOCK_Q) & (head_in_group < QUERIES_PER_KV) & (q_tok < q_len)
    q_pos = context + q_tok
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < head_dim

    q_row = (q_begin + q_tok).to(tl.int64)
    q = tl.load(
        query_ptr + q_row[:, None] * q_s0 + head[:, None] * q_s1 + dims[None, :] * q_s2,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)

    # Keys this tile can see: positions 0 .. (last query position in the tile), or with a
    # window from the first query's earliest key (its tile) on: O(window) key tiles.
    num_keys = context + tl.minimum(tile_q0 + BLOCK_Q, q_len)
    min_key = 0
    first_key = 0
    if HAS_WINDOW:
        min_key = tl.maximum(context + tile_q0 - window + 1, 0)
        first_key = min_key // TILE_N * TILE_N
    table = block_tables_ptr + seq.to(tl.int64) * bt_s0
    m_i, l_i, acc = attend_key_range(
        first_key, min_key, num_keys, q, q_pos, row_ok, m_i, l_i, acc, table, bt_s1,
        key_cache_ptr, value_cache_ptr, kc_s0, kc_s1, kc_s2, kc_s3,
        vc_s0, vc_s1, vc_s2, vc_s3, key_scale_ptr, value_scale_ptr, ks_s0, ks_s1, ks_s2,
        kv_head, dims, dim_ok, scale, window, softcap,
        TILE_N, BLOCK_SIZE, IEEE_DOT, HAS_WINDOW, HAS_SOFTCAP, QUANT, INTERPRETER_LOOP,
    )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_row[:, None] * o_s0 + head[:, None] * o_s1 + dims[None, :] * o_s2,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _launch_tiles(
    launch: TileLaunch,
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
    constexprs = kernel_constexprs(
        launch.kind,
        queries_per_kv=schedule.queries_per_kv,
        head_dim=schedule.head_dim,
        block_size=schedule.block_size,
        dtype=query.dtype,
        has_window=window > 0,
        has_softcap=softcap > 0,
        quantized=scales is not None,
    )
    _paged_attention_kernel[(launch.num_tiles, schedule.num_kv_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        launch.seqs,
        launch.tile_start,
        float(scale),
        window,
        softcap if softcap else 1.0,
        launch.num_seqs,
        schedule.head_dim,
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *scale_args(key_cache, scales),
        *block_tables.stride(),
        **constexprs,
        num_warps=NUM_WARPS[launch.kind],
    )


def schedule_for(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_sms: int | None = None,
) -> AttentionSchedule:
    """A schedule built from the tensors themselves (copies them to the host: a sync on
    CUDA; a served step builds its schedule with
    :func:`~gpu_worker.kernels.attention_schedule.plan_attention` from host arrays)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    return plan_attention(
        query_start_loc.cpu().numpy(),
        seq_lens.cpu().numpy(),
        num_kv_heads=num_kv_heads,
        queries_per_kv=query.shape[1] // num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_sms=num_sms,
        device=query.device,
    )


def _check_schedule(
    schedule: AttentionSchedule, query: torch.Tensor, key_cache: torch.Tensor, num_seqs: int
) -> None:
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    expected = (num_kv_heads, query.shape[1] // num_kv_heads, head_dim, block_size, num_seqs)
    got = (
        schedule.num_kv_heads,
        schedule.queries_per_kv,
        schedule.head_dim,
        schedule.block_size,
        schedule.num_seqs,
    )
    if got != expected or schedule.num_tokens > query.shape[0]:
        raise ValueError(
            f"schedule (kv heads, queries per kv, head_dim, block size, seqs) {got} and "
            f"{schedule.num_tokens} tokens do not fit {expected} and {query.shape[0]} tokens"
        )


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    schedule: AttentionSchedule | None = None,
    scales: Scales | None = None,
) -> torch.Tensor:
    """Causal paged attention for a packed batch of prefill chunks and decodes, as the
    torch backend's attention (flash-style online softmax over the
    sequence's KV blocks; with a window, only over the blocks the window reaches). Query
    rows outside every sequence are left uninitialised.

    ``schedule``: the step's, from
    :func:`~gpu_worker.kernels.attention_schedule.plan_attention` over the host arrays of
    the same ``query_start_loc`` and ``seq_lens`` (it says which launch takes which
    sequence; the kernels read the lengths from the tensors); None builds one from the
    tensors (a host sync on CUDA; split-KV decodes by the device's multiprocessor count).
    ``scales``: a quantized cache's (key, value) scales [blocks, block_size, kv_heads],
    whose caches then hold 8-bit codes (:mod:`gpu_worker.kv_quant`).
    """
    window, cap = check_args(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, window, softcap
    )
    return launch_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        window, cap, schedule, scales,
    )  # fmt: skip


def launch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int,
    cap: float,
    schedule: AttentionSchedule | None,
    scales: Scales | None = None,
) -> torch.Tensor:
    """:func:`paged_attention_triton` on arguments :func:`check_args` already passed
    (``window``/``cap`` 0: none), as the Triton backend calls it."""
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if query.shape[0] == 0 or num_seqs == 0:
        return out
    if schedule is None:
        schedule = schedule_for(query, key_cache, seq_lens, query_start_loc)
    _check_schedule(schedule, query, key_cache, num_seqs)
    index = {"device": query.device, "dtype": torch.int32}
    block_tables = block_tables.to(**index)
    seq_lens, query_start_loc = seq_lens.to(**index), query_start_loc.to(**index)
    args = (out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    args += (float(scale), window, cap)
    for launch in (schedule.decode, schedule.prefill):
        if launch is not None:
            _launch_tiles(launch, schedule, *args, scales)
    if schedule.split is not None:
        split_kv_decode(schedule.split, schedule, *args, scales)
    return out


__all__ = ["launch_paged_attention", "paged_attention_triton", "schedule_for"]
