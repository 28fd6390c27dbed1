"""Paged attention over mixed batches of prefill chunks and decodes (causal, GQA, with an
optional sliding window and attention-logit soft-capping)."""

# Triton kernel parameters stay unannotated: Triton reads annotations for specialisation.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gpu_worker.kernels.cpu_attention import (
    check_attention_args,
    check_window_softcap,
    paged_attention_cpu,
)
from gpu_worker.kernels.store_kv import use_triton


def paged_attention_ref(
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
) -> torch.Tensor:
    """Torch reference: gather each sequence's K/V through its block table and attend
    causally in float32. Query rows outside ``query_start_loc[0]:query_start_loc[-1]``
    are zero. Decodes (one query row) are computed together, padded to the longest
    context; prefill chunks one sequence at a time. ``window``: a query at position p
    sees only keys k with ``p - window < k <= p`` (None or 0: no window); ``softcap``:
    the scaled scores become ``softcap * tanh(scores / softcap)`` before masking (None:
    no capping); see :func:`~gpu_worker.kernels.cpu_attention.check_window_softcap`.
    """
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    window, cap = check_window_softcap(window, softcap)
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.to(device=key_cache.device, dtype=torch.int64)
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1 and lens[s] > 0]
    for first in range(0, len(decodes), _DECODE_CHUNK):
        _decode_ref(
            out,
            query,
            key_cache,
            value_cache,
            tables,
            lens,
            starts,
            decodes[first : first + _DECODE_CHUNK],
            scale,
            window,
            cap,
        )
    chunked = set(decodes)
    for s, seq_len in enumerate(lens):
        if s not in chunked and starts[s + 1] > starts[s]:
            _prefill_ref(
                out,
                query,
                key_cache,
                value_cache,
                tables[s],
                seq_len,
                starts[s],
                starts[s + 1],
                scale,
                window,
                cap,
            )
    return out


_DECODE_CHUNK = 64
"""Decodes computed per batched call (bounds the padded K/V copy)."""


def _decode_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    starts: list[int],
    seqs: list[int],
    scale: float,
    window: int,
    softcap: float,
) -> None:
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    device = key_cache.device
    seq_lens = torch.tensor([lens[s] for s in seqs], device=device)
    longest = int(seq_lens.max())
    num_blocks = -(-longest // block_size)
    rows = torch.tensor(seqs, device=device)
    block_index = torch.arange(num_blocks, device=device)
    # Table entries past a sequence's own blocks may hold anything: read block 0 there
    # (masked out below).
    valid = block_index[None, :] < ((seq_lens + block_size - 1) // block_size)[:, None]
    blocks = torch.where(valid, tables[rows, :num_blocks], 0)
    k = key_cache[blocks].reshape(len(seqs), -1, num_kv_heads, head_dim).float()
    v = value_cache[blocks].reshape(len(seqs), -1, num_kv_heads, head_dim).float()
    key_pos = torch.arange(k.shape[1], device=device)
    key_ok = key_pos[None, :] < seq_lens[:, None]
    # Slots past a context may hold anything, even NaN: their scores become -inf below,
    # and their values are zeroed so that probability 0 times the slot stays 0.
    v = v.masked_fill(~key_ok[:, :, None, None], 0.0)
    q_rows = torch.tensor([starts[s] for s in seqs], device=query.device)
    q = query[q_rows].float().view(len(seqs), num_kv_heads, group, head_dim)
    scores = _cap(torch.einsum("skgd,slkd->skgl", q, k) * scale, softcap)
    if window:  # the query sits at position seq_len - 1
        key_ok = key_ok & (key_pos[None, :] >= seq_lens[:, None] - window)
    scores = scores.masked_fill(~key_ok[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.einsum("skgl,slkd->skgd", probs, v).reshape(len(seqs), -1, head_dim)
    out[q_rows] = result.to(query.dtype)


def _prefill_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    q_begin: int,
    q_end: int,
    scale: float,
    window: int,
    softcap: float,
) -> None:
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    q_len = q_end - q_begin
    num_blocks = -(-seq_len // block_size)
    blocks = table[:num_blocks]
    k = key_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]
    v = value_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]
    k = k.float().repeat_interleave(group, dim=1)  # [seq_len, heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    q = query[q_begin:q_end].float()  # [q_len, heads, head_dim]
    scores = _cap(torch.einsum("qhd,khd->hqk", q, k) * scale, softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    k_pos = torch.arange(seq_len, device=query.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


def _cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)``, or ``scores`` when ``softcap`` is 0."""
    return softcap * torch.tanh(scores / softcap) if softcap else scores


@triton.jit
def _find_seq(
    query_start_loc_ptr,
    tile,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    # Sequence s owns the tile indices [first(s), first(s+1)) with
    # first(s) = query_start_loc[s] // BLOCK_Q + s, which always leaves room for its
    # ceil(q_len / BLOCK_Q) tiles. Binary search for the last s with first(s) <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_key_tile(
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


@triton.jit(do_not_specialize=["window", "num_seqs", "bt_s0"])
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    window,
    softcap,
    num_seqs,
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
):
    # One program per (query tile of one sequence, kv head). A tile holds BLOCK_Q query
    # tokens x the QUERIES_PER_KV query heads sharing this kv head, as BLOCK_M rows
    # (row r -> token r // QPK_PAD, head r % QPK_PAD), so every K/V tile loaded is used
    # by the whole GQA group.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    local_tile = tile - (q_begin // BLOCK_Q + seq)
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
    if INTERPRETER_LOOP:
        # Older Triton interpreters cannot take a runtime tensor as a range() bound.
        start_n = first_key
        while start_n < num_keys:
            m_i, l_i, acc = _attend_key_tile(
                start_n, min_key, num_keys, q, q_pos, row_ok, m_i, l_i, acc, table, bt_s1,
                key_cache_ptr, value_cache_ptr, kc_s0, kc_s1, kc_s2, kc_s3,
                vc_s0, vc_s1, vc_s2, vc_s3, kv_head, dims, dim_ok, scale, window, softcap,
                TILE_N, BLOCK_SIZE, IEEE_DOT, HAS_WINDOW, HAS_SOFTCAP,
            )  # fmt: skip
            start_n += TILE_N
    else:
        for start_n in range(first_key, num_keys, TILE_N):
            m_i, l_i, acc = _attend_key_tile(
                start_n, min_key, num_keys, q, q_pos, row_ok, m_i, l_i, acc, table, bt_s1,
                key_cache_ptr, value_cache_ptr, kc_s0, kc_s1, kc_s2, kc_s3,
                vc_s0, vc_s1, vc_s2, vc_s3, kv_head, dims, dim_ok, scale, window, softcap,
                TILE_N, BLOCK_SIZE, IEEE_DOT, HAS_WINDOW, HAS_SOFTCAP,
            )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_row[:, None] * o_s0 + head[:, None] * o_s1 + dims[None, :] * o_s2,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _tile_config(num_tokens: int, num_seqs: int, queries_per_kv: int) -> tuple[int, int, int]:
    """(QPK_PAD, BLOCK_Q, BLOCK_M) from shapes only (no device sync)."""
    qpk_pad = triton.next_power_of_2(queries_per_kv)
    avg_q_len = num_tokens / max(num_seqs, 1)
    target_m = 16 if avg_q_len <= 4 else 64
    block_m = max(target_m, qpk_pad)
    return qpk_pad, block_m // qpk_pad, block_m


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
) -> torch.Tensor:
    """Triton version of :func:`paged_attention_ref` (flash-style online softmax over the
    sequence's KV blocks; with a window, only over the blocks the window reaches). Query
    rows outside every sequence are left uninitialised.
    """
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    window, cap = check_window_softcap(window, softcap)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    device = query.device
    block_tables = block_tables.to(device=device, dtype=torch.int32)
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    query_start_loc = query_start_loc.to(device=device, dtype=torch.int32)

    queries_per_kv = num_heads // num_kv_heads
    qpk_pad, block_q, block_m = _tile_config(num_tokens, num_seqs, queries_per_kv)
    # Upper bound on tiles over all sequences (see _find_seq); extra programs exit.
    num_tiles = num_tokens // block_q + num_seqs
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = 32 if dim_pad <= 128 else 16
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale),
        window,
        cap if cap else 1.0,
        num_seqs,
        head_dim,
        *query.stride(),
        *out.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        QUERIES_PER_KV=queries_per_kv,
        QPK_PAD=qpk_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        IEEE_DOT=query.dtype == torch.float32,
        HAS_WINDOW=window > 0,
        HAS_SOFTCAP=cap > 0,
        INTERPRETER_LOOP=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=4,
    )
    return out


def paged_attention(
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
) -> torch.Tensor:
    """Causal paged attention for a packed batch of prefill chunks and decodes.

    ``query`` [tokens, heads, head_dim]; sequence ``s`` owns rows
    ``query_start_loc[s]:query_start_loc[s+1]``, which sit at the last positions of its
    ``seq_lens[s]`` context (K/V already in the cache via ``block_tables[s]``). Returns
    ``[tokens, heads, head_dim]`` in ``query.dtype``. CUDA tensors take the Triton kernel,
    others :func:`~gpu_worker.kernels.cpu_attention.paged_attention_cpu` (the torch
    reference stays the oracle of both). ``window``: the layer's sliding window, a query at
    position p seeing keys ``p - window < k <= p`` (None or 0: none); ``softcap``: scores
    capped to ``softcap * tanh(scores / softcap)`` before masking (None: none).
    """
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    if use_triton(query, key_cache):
        return paged_attention_triton(*args, window=window, softcap=softcap)
    return paged_attention_cpu(*args, window=window, softcap=softcap)


__all__ = ["paged_attention", "paged_attention_ref", "paged_attention_triton"]
