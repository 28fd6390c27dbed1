"""Device functions shared by the attention kernels: finding a program's sequence in a
launch, one online-softmax step over a tile of a sequence's paged keys, and the loop of
those steps over a range of keys."""

# Triton kernel parameters stay unannotated: Triton reads annotations for specialisation.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def find_slot(starts_ptr, index, count):
    # The last i in [0, count) with starts[i] <= index (starts non-decreasing, starts[0]
    # = 0 <= index): which of a launch's sequences owns program ``index``, when sequence
    # i owns the programs [starts[i], starts[i + 1]). Binary search.
    lo = 0
    hi = count
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(starts_ptr + mid) <= index:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def attend_key_tile(
    start_n,
    min_key,
    num_keys,
    q,
    q_pos,
    row_ok,
    m_i,
    l_i,
    acc,
    table,
    bt_s1,
    key_cache_ptr,
    value_cache_ptr,
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
    kv_head,
    dims,
    dim_ok,
    scale,
    window,
    softcap,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    # One online-softmax step over keys [start_n, start_n + TILE_N) of the sequence; each
    # key's physical slot comes from the block table, so a tile may span several blocks
    # (or part of one) whatever the block size. With a window, keys before ``min_key``
    # (seen by no row of the tile) are not loaded, nor their block table entries.
    keys = start_n + tl.arange(0, TILE_N)
    key_ok = keys < num_keys
    if HAS_WINDOW:
        key_ok = key_ok & (keys >= min_key)
    block = tl.load(table + (keys // BLOCK_SIZE) * bt_s1, mask=key_ok, other=0).to(tl.int64)
    in_block = keys % BLOCK_SIZE
    k_base = block * kc_s0 + in_block * kc_s1 + kv_head * kc_s2
    v_base = block * vc_s0 + in_block * vc_s1 + kv_head * vc_s2
    k = tl.load(  # [DIM_PAD, TILE_N]
        key_cache_ptr + k_base[None, :] + dims[:, None] * kc_s3,
        mask=key_ok[None, :] & dim_ok[:, None],
        other=0.0,
    )
    v = tl.load(  # [TILE_N, DIM_PAD]
        value_cache_ptr + v_base[:, None] + dims[None, :] * vc_s3,
        mask=key_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if QUANT:
        # 8-bit codes times their rows' float16 scales (one per key and kv head; the
        # value scales sit at the same offsets of their own view).
        scale_at = block * ks_s0 + in_block * ks_s1 + kv_head * ks_s2
        k_scale = tl.load(key_scale_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)
        v_scale = tl.load(value_scale_ptr + scale_at, mask=key_ok, other=0.0).to(tl.float32)
        k = (k.to(tl.float32) * k_scale[None, :]).to(q.dtype)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    if IEEE_DOT:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * scale
    if HAS_SOFTCAP:
        # softcap * tanh(s / softcap), with tanh(x) = 2 * sigmoid(2x) - 1: finite for
        # every x (sigmoid saturates to 0 or 1), and the interpreter has no tanh.
        s = softcap * (2.0 * tl.sigmoid(s * (2.0 / softcap)) - 1.0)
    visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (keys[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen no key yet keep m = -inf; shift them by 0 to avoid NaNs.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_shift[:, None])
    alpha = tl.exp(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if IEEE_DOT:
        acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def attend_key_range(
    first_key,
    min_key,
    end,
    q,
    q_pos,
    row_ok,
    m_i,
    l_i,
    acc,
    table,
    bt_s1,
    key_cache_ptr,
    value_cache_ptr,
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
    kv_head,
    dims,
    dim_ok,
    scale,
    window,
    softcap,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
    INTERPRETER_LOOP: tl.constexpr,
):
    # attend_key_tile over the key tiles from first_key up to end (keys below min_key
    # and from end on masked); returns the updated (m_i, l_i, acc).
    if INTERPRETER_LOOP:
        # Older Triton interpreters cannot take a runtime tensor as a range() bound.
        start_n = first_key
        while start_n < end:
            m_i, l_i, acc = attend_key_tile(
                start_n, min_key, end, q, q_pos, row_ok, m_i, l_i, acc, table, bt_s1,
                key_cache_ptr, value_cache_ptr, kc_s0, kc_s1, kc_s2, kc_s3,
                vc_s0, vc_s1, vc_s2, vc_s3, key_scale_ptr, value_scale_ptr, ks_s0, ks_s1, ks_s2,
                kv_head, dims, dim_ok, scale, window, softcap,
                TILE_N, BLOCK_SIZE, IEEE_DOT, HAS_WINDOW, HAS_SOFTCAP, QUANT,
            )  # fmt: skip
            start_n += TILE_N
    else:
        for start_n in range(first_key, end, TILE_N):
            m_i, l_i, acc = attend_key_tile(
                start_n, min_key, end, q, q_pos, row_ok, m_i, l_i, acc, table, bt_s1,
                key_cache_ptr, value_cache_ptr, kc_s0, kc_s1, kc_s2, kc_s3,
                vc_s0, vc_s1, vc_s2, vc_s3, key_scale_ptr, value_scale_ptr, ks_s0, ks_s1, ks_s2,
                kv_head, dims, dim_ok, scale, window, softcap,
                TILE_N, BLOCK_SIZE, IEEE_DOT, HAS_WINDOW, HAS_SOFTCAP, QUANT,
            )  # fmt: skip
    return m_i, l_i, acc
