"""Paged attention on CPU: padded groups of sequences through torch's fused SDPA.

The same contract as :func:`gpu_worker.kernels.paged_attention.paged_attention_ref` (mixed
batches of prefill chunks and decodes, causal, GQA), built for speed where there is no
Triton: sequences are grouped by padded size, and each group is one batched gather of its
blocks through the block table, one masked ``scaled_dot_product_attention`` call with
``enable_gqa`` (K/V heads are never repeated) and one scatter of the result rows. Nothing
is upcast: the inputs' dtype goes straight to SDPA, which accumulates in float32. A
sliding window is part of the mask; a logit softcap, which SDPA cannot apply, takes an
explicit float32 attention instead (still without repeating K/V heads).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator

import torch
import torch.nn.functional as F


def check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Shapes shared by every paged-attention implementation (raises ``ValueError``)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"caches must be [blocks, block_size, kv_heads, head_dim], got {key_cache.shape}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {block_tables.shape}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {query_start_loc.shape}")


def check_window_softcap(window: int | None, softcap: float | None) -> tuple[int, float]:
    """``(window, softcap)`` with 0 for "none" (raises ``ValueError`` on bad values).

    ``window``: a query at position p sees keys k with ``p - window < k <= p`` (the last
    ``window`` positions, its own included; transformers' sliding window); None or 0 for
    no window. ``softcap``: the scaled scores become ``softcap * tanh(scores / softcap)``
    before masking (Gemma 2); None for no capping.
    """
    size = -1
    if window is None:
        size = 0
    elif not isinstance(window, bool):
        with contextlib.suppress(TypeError):
            size = operator.index(window)
    if size < 0:
        raise ValueError(f"window must be an int >= 1 (or None/0 for none), got {window!r}")
    if softcap is None:
        return size, 0.0
    cap = math.nan
    if not isinstance(softcap, bool):
        with contextlib.suppress(TypeError, ValueError):
            cap = float(softcap)
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap must be a finite float > 0 (or None), got {softcap!r}")
    return size, cap


_PAD_SLACK = 1.5
"""A group's padded (query rows x keys) area stays within this factor of its real area."""

_GROUP_ELEMENTS = 1 << 23
"""Bound on a group's gathered K (and padded query) elements, unless one sequence alone
is larger: it bounds the copies a group makes and the scratch buffers they reuse."""


class _Scratch:
    """Grow-only buffers for the gathered K/V, reused by every group, layer and step:
    writing into memory already touched saves the page faults of fresh large allocations,
    which cost more than the copy itself. One forward at a time per process, as in the
    worker.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, slot: int, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A ``shape`` buffer of ``like``'s dtype and device, slot 0 or 1 (K or V)."""
        numel = 1
        for size in shape:
            numel *= size
        key = (slot, like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # A normal tensor even under inference mode, which may be left before the next
            # call (an inference tensor takes no in-place writes outside of it).
            with torch.inference_mode(False):
                buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


SCRATCH = _Scratch()


def group_sequences(
    seqs: list[int],
    q_lens: list[int],
    lens: list[int],
    kv_row: int,
    q_row: int,
    waste: float = 0.0,
) -> list[list[int]]:
    """Sequences by decreasing (query rows x keys), cut greedily into groups whose padding
    stays within :data:`_PAD_SLACK` (or within ``waste`` padded query rows x keys over
    the real ones, when that is more: where a group costs more than its padding) and
    whose copies within :data:`_GROUP_ELEMENTS`. Decodes (one query row) fall together,
    shortest contexts apart from the longest.
    """
    areas = [q * n for q, n in zip(q_lens, lens, strict=True)]
    order = sorted(seqs, key=areas.__getitem__, reverse=True)
    groups: list[list[int]] = []
    group: list[int] = []
    max_q = max_len = area = 0
    for s in order:
        q = q_lens[s] if q_lens[s] > max_q else max_q
        keys = lens[s] if lens[s] > max_len else max_len
        n = len(group) + 1
        padded = n * q * keys
        total = area + areas[s]
        fits = (padded <= _PAD_SLACK * total or padded <= total + waste) and (
            n * keys * kv_row <= _GROUP_ELEMENTS and n * q * q_row <= _GROUP_ELEMENTS
        )
        if group and not fits:
            groups.append(group)
            group, q, keys, total = [], q_lens[s], lens[s], areas[s]
        group.append(s)
        max_q, max_len, area = q, keys, total
    if group:
        groups.append(group)
    return groups


def paged_attention_cpu(
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
    """:func:`~gpu_worker.kernels.paged_attention.paged_attention_ref`'s results (within
    float tolerance), computed a group of sequences at a time. Query rows outside
    ``query_start_loc[0]:query_start_loc[-1]`` are zero. ``window``/``softcap``: see
    :func:`check_window_softcap`; with a softcap the scores are computed explicitly in
    float32 (SDPA cannot cap them).
    """
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    window, cap = check_window_softcap(window, softcap)
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [end - begin for begin, end in itertools.pairwise(starts)]
    active = [s for s, seq_len in enumerate(lens) if q_lens[s] > 0 and seq_len > 0]
    num_heads, head_dim = query.shape[1:]
    kv_row = key_cache.shape[2] * head_dim
    tables = block_tables.to(device=key_cache.device, dtype=torch.int64)
    for group in group_sequences(active, q_lens, lens, kv_row, num_heads * head_dim):
        _attend_group(
            out,
            query,
            key_cache,
            value_cache,
            tables[group],
            torch.tensor([lens[s] for s in group], device=query.device),
            torch.tensor([starts[s] for s in group], device=query.device),
            torch.tensor([q_lens[s] for s in group], device=query.device),
            scale,
            window,
            cap,
        )
    return out


def _attend_group(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_begins: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """One padded SDPA call for the group's sequences (``tables`` their block tables);
    ``window``/``softcap`` 0 for none."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    device = query.device
    n = seq_lens.shape[0]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    keys = num_blocks * block_size
    max_q = int(q_lens.max())

    # Table entries past a sequence's own blocks may hold anything: read block 0 there.
    block_index = torch.arange(num_blocks, device=device)
    own = block_index[None, :] < ((seq_lens + block_size - 1) // block_size)[:, None]
    blocks = torch.where(own, tables[:, :num_blocks], 0).view(-1)
    gathered = (blocks.shape[0], block_size, num_kv_heads, head_dim)
    k = torch.index_select(key_cache, 0, blocks, out=SCRATCH.take(0, key_cache, gathered))
    v = torch.index_select(value_cache, 0, blocks, out=SCRATCH.take(1, value_cache, gathered))
    k = k.view(n, keys, num_kv_heads, head_dim)
    v = v.view(n, keys, num_kv_heads, head_dim)
    # Slots past a context may hold anything, even NaN, which a masked score would not
    # hide (NaN - inf is NaN): zero them in the copies.
    key_pos = torch.arange(keys, device=device)
    past = key_pos[None, :] >= seq_lens[:, None]  # [n, keys]
    stale = past.view(-1).nonzero().view(-1)
    k.view(n * keys, num_kv_heads, head_dim).index_fill_(0, stale, 0.0)
    v.view(n * keys, num_kv_heads, head_dim).index_fill_(0, stale, 0.0)

    # Query row i of sequence s sits at position seq_len - q_len + i; padded rows (i past
    # q_len) repeat the last row, position included, so no row is fully masked.
    row = torch.arange(max_q, device=device)
    last = torch.minimum(row[None, :], (q_lens - 1)[:, None])  # [n, max_q]
    q_pos = (seq_lens - q_lens)[:, None] + last
    rows = q_begins[:, None] + last
    q = query.index_select(0, rows.view(-1)).view(n, max_q, -1, head_dim)
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & ~past[:, None, :]
    if window:
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - window
    if softcap:
        attn = _softcapped_attention(q, k, v, visible, scale, softcap)
    else:
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=visible[:, None],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [n, max_q, heads, head_dim]
    real = row[None, :] < q_lens[:, None]
    out.index_copy_(0, rows[real], attn[real])


_SCORE_ELEMENTS = 1 << 24
"""Bound on the float32 scores :func:`_softcapped_attention` holds at once (unless one
query row of the group alone needs more)."""


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Explicit attention in float32 with capped scores: q [n, max_q, heads, head_dim],
    k/v [n, keys, kv_heads, head_dim], visible [n, max_q, keys] -> [n, max_q, heads,
    head_dim] in q's dtype. The query heads of a KV head are the rows of one matmul (K/V
    heads are never repeated), a chunk of query rows at a time."""
    n, max_q, heads, head_dim = q.shape
    keys, num_kv_heads = k.shape[1], k.shape[2]
    group = heads // num_kv_heads
    k_t = k.float().permute(0, 2, 3, 1)  # [n, kv_heads, head_dim, keys]
    v_h = v.float().transpose(1, 2)  # [n, kv_heads, keys, head_dim]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    step = max(1, _SCORE_ELEMENTS // max(1, n * heads * keys))
    for first in range(0, max_q, step):
        m = min(step, max_q - first)
        # [n, kv_heads, m * group, head_dim]: row i * group + j is query row first + i of
        # head kv_head * group + j.
        qc = q[:, first : first + m].float().view(n, m, num_kv_heads, group, head_dim)
        qc = qc.transpose(1, 2).reshape(n, num_kv_heads, m * group, head_dim)
        scores = torch.matmul(qc, k_t).mul_(scale / softcap).tanh_().mul_(softcap)
        scores = scores.view(n, num_kv_heads, m, group, keys)
        mask = visible[:, None, first : first + m, None, :]
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores.view(n, num_kv_heads, m * group, keys), dim=-1)
        attn = torch.matmul(probs, v_h).view(n, num_kv_heads, m, group, head_dim)
        out[:, first : first + m] = attn.transpose(1, 2).reshape(n, m, heads, head_dim)
    return out
