"""Torch reference of paged attention: the oracle of the Triton kernels
(:mod:`gpu_worker.kernels.paged_attention`, :mod:`gpu_worker.kernels.split_kv`) and of
:func:`~gpu_worker.kernels.cpu_attention.paged_attention_cpu`."""

from __future__ import annotations

import torch

from gpu_worker.kernels.cpu_attention import check_attention_args, check_window_softcap


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


__all__ = ["paged_attention_ref"]
