"""expeditor's attention, registered with transformers' attention interface.

The model runs one packed forward per step: batch 1, every scheduled token side by side,
explicit ``position_ids`` and ``use_cache=False``. Each attention layer receives the
step's :class:`StepMetadata` as the keyword ``expeditor_meta``; it stores the new K/V
into their cache slots, then attends over the paged cache (the prompt chunks causally,
decodes over their whole context).

On CUDA (or with ``EXPEDITOR_FORCE_TRITON=1``) every layer calls the Triton kernels.
Elsewhere the first layer of a step builds a :class:`CpuStepPlan` from the metadata and
every layer reuses it: the cache indices of the new tokens, and per group of sequences
(:func:`~gpu_worker.kernels.cpu_attention.paged_attention_cpu`'s groups) the blocks to
gather, the stale rows to zero, the query rows and the attention mask. A layer then
does only its stores, copies and one SDPA call per group: ``paged_attention_cpu``'s
operations, except that groups of whole prompts use SDPA's own causal mask and groups
of few query rows (decodes) fold the query heads of each KV head into the rows of one
head, which reads each K/V row once for all of them. Both give the same values up to
float rounding (tests/test_attention_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from gpu_worker.kernels import paged_attention, store_kv, use_triton
from gpu_worker.kernels.cpu_attention import SCRATCH, check_attention_args, group_sequences

ATTN_IMPLEMENTATION = "expeditor_paged"

_FOLD_MAX_Q = 16
"""Groups with at most this many query rows per sequence fold their GQA heads."""


@dataclass(slots=True)
class CpuGroup:
    """One padded SDPA call of a step: ``n`` sequences, ``keys`` gathered key slots and
    ``max_q`` query rows each."""

    n: int
    keys: int
    max_q: int
    blocks: torch.Tensor
    """[n * keys / block_size] int64: the cache blocks to gather (block 0 past a
    sequence's own blocks)."""
    stale: torch.Tensor | None
    """Rows of the gathered ``[n * keys]`` K/V past each context (zeroed), or None."""
    rows: torch.Tensor
    """[n * max_q] int64: query row of each padded row (padding repeats the last)."""
    mask: torch.Tensor | None
    """Additive (0 or -inf, the query's dtype) over the keys: [n, 1, max_q, keys], or
    [n, 1, max_q * heads per KV head, keys] when ``fold`` (1 row when max_q is 1);
    None when ``causal``."""
    causal: bool
    """Every sequence is a whole prompt from position 0: SDPA's own causal mask."""
    fold: bool
    """The query heads of each KV head attend as the rows of one head (few query rows:
    each K/V row is then read once for all of them, not once per query head)."""
    real: torch.Tensor | None
    """[n * max_q] bool: padded rows that are real ones, None when all are."""
    out_rows: torch.Tensor
    """Output row of each real padded row."""


@dataclass(slots=True)
class CpuStepPlan:
    """Everything about a step's CPU attention that does not depend on the layer."""

    store_index: tuple[torch.Tensor, torch.Tensor] | None
    """(block, offset) of every new token with a slot, None when there are none."""
    store_tokens: torch.Tensor | None
    """The tokens with a slot (slot >= 0), None when every token has one."""
    groups: list[CpuGroup]
    covers_all: bool
    """The groups write every query row (the output needs no zero fill)."""


@dataclass(slots=True)
class StepMetadata:
    """Per-step attention inputs, shared by every layer."""

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block * block_size + offset) of each new token."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: context length after this step's tokens."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: where each sequence's tokens start in the packed batch."""
    layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer: (key cache, value cache) views of the device KV cache."""
    cpu_plan: CpuStepPlan | None = None
    """Built by the first layer of a step off the Triton path."""


def plan_cpu_step(meta: StepMetadata, query: torch.Tensor, key_cache: torch.Tensor) -> CpuStepPlan:
    """The layer-independent part of ``store_kv_ref`` and ``paged_attention_cpu`` for a
    step whose query is ``query`` [tokens, heads, head_dim] and caches ``key_cache``'s
    shape (host tensors: the indices are built with numpy)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    device = key_cache.device
    slots = meta.slot_mapping.cpu().numpy().astype(np.int64, copy=False)
    store_tokens = None
    if slots.size and slots.min() < 0:
        kept = np.flatnonzero(slots >= 0)
        store_tokens, slots = _tensor(kept, device), slots[kept]
    store_index = None
    if slots.size:
        store_index = (
            _tensor(slots // block_size, device),
            _tensor(slots % block_size, device),
        )

    starts = meta.query_start_loc.cpu().numpy().astype(np.int64)
    lens = meta.seq_lens.cpu().numpy().astype(np.int64)
    q_lens = starts[1:] - starts[:-1]
    active = np.flatnonzero((q_lens > 0) & (lens > 0)).tolist()
    tables = meta.block_tables.cpu().numpy()
    q_list, len_list = q_lens.tolist(), lens.tolist()
    kv_row = num_kv_heads * head_dim
    groups = [
        _plan_group(np.array(group), tables, lens, starts, q_lens, block_size, query, num_kv_heads)
        for group in group_sequences(active, q_list, len_list, kv_row, query.shape[1] * head_dim)
    ]
    covers_all = int(q_lens[active].sum()) == query.shape[0]
    return CpuStepPlan(store_index, store_tokens, groups, covers_all)


def _plan_group(
    group: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    starts: np.ndarray,
    q_lens: np.ndarray,
    block_size: int,
    query: torch.Tensor,
    num_kv_heads: int,
) -> CpuGroup:
    """``paged_attention_cpu``'s per-group indices and mask, computed once."""
    n = len(group)
    seq_lens = lens[group]
    group_q = q_lens[group]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    keys = num_blocks * block_size
    max_q = int(group_q.max())

    # Table entries past a sequence's own blocks may hold anything: read block 0 there.
    own = np.arange(num_blocks)[None, :] < (-(-seq_lens // block_size))[:, None]
    blocks = np.where(own, tables[group, :num_blocks], 0).astype(np.int64).reshape(-1)
    key_pos = np.arange(keys)
    past = key_pos[None, :] >= seq_lens[:, None]  # [n, keys]
    stale = None
    if int(seq_lens.min()) < keys:
        stale = _tensor(np.flatnonzero(past), query.device)

    row = np.arange(max_q)
    rows = (starts[group][:, None] + np.minimum(row[None, :], (group_q - 1)[:, None])).reshape(-1)
    # Whole prompts (from position 0): query row i sees keys 0..i, SDPA's own causal
    # mask. A padded row sees zeroed stale keys too, and is dropped.
    causal = bool((group_q == seq_lens).all())
    per_kv_head = query.shape[1] // num_kv_heads
    fold = not causal and per_kv_head > 1 and max_q <= _FOLD_MAX_Q
    mask = None
    if not causal:
        q_pos = (seq_lens - group_q)[:, None] + row[None, :]  # [n, max_q]
        visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & ~past[:, None, :]
        if fold and max_q > 1:
            visible = np.repeat(visible, per_kv_head, axis=1)
        hidden = _tensor(~visible, query.device)[:, None]
        mask = torch.zeros(hidden.shape, dtype=query.dtype, device=query.device)
        mask.masked_fill_(hidden, -torch.inf)
    if int(group_q.min()) == max_q:
        real, out_rows = None, rows
    else:
        real_np = (row[None, :] < group_q[:, None]).reshape(-1)
        real, out_rows = _tensor(real_np, query.device), rows[real_np]
    return CpuGroup(
        n,
        keys,
        max_q,
        _tensor(blocks, query.device),
        stale,
        _tensor(rows, query.device),
        mask,
        causal,
        fold,
        real,
        _tensor(np.ascontiguousarray(out_rows), query.device),
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (shared memory on the host)."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


def attend_cpu(
    plan: CpuStepPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_attention_cpu`` over the planned groups: ``query`` [tokens, heads,
    head_dim] -> the same shape."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    out = torch.empty_like(query) if plan.covers_all else torch.zeros_like(query)
    for g in plan.groups:
        gathered = (g.blocks.shape[0], block_size, num_kv_heads, head_dim)
        k = torch.index_select(key_cache, 0, g.blocks, out=SCRATCH.take(0, key_cache, gathered))
        v = torch.index_select(value_cache, 0, g.blocks, out=SCRATCH.take(1, value_cache, gathered))
        if g.stale is not None:
            k.view(g.n * g.keys, num_kv_heads, head_dim).index_fill_(0, g.stale, 0.0)
            v.view(g.n * g.keys, num_kv_heads, head_dim).index_fill_(0, g.stale, 0.0)
        k = k.view(g.n, g.keys, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(g.n, g.keys, num_kv_heads, head_dim).transpose(1, 2)
        q = query.index_select(0, g.rows)  # [n * max_q, heads, head_dim]
        if g.fold:
            # [n, kv_heads, max_q * heads per KV head, head_dim]: row i * per + j is
            # query row i of head kv_head * per + j (GQA's head order).
            q = q.view(g.n, g.max_q, num_kv_heads, -1, head_dim).transpose(1, 2)
            q = q.reshape(g.n, num_kv_heads, -1, head_dim)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
            attn = attn.view(g.n, num_kv_heads, g.max_q, -1, head_dim).transpose(1, 2)
        else:
            attn = F.scaled_dot_product_attention(
                q.view(g.n, g.max_q, -1, head_dim).transpose(1, 2),
                k,
                v,
                attn_mask=g.mask,
                is_causal=g.causal,
                scale=scale,
                enable_gqa=True,
            ).transpose(1, 2)  # [n, max_q, heads, head_dim]
        rows = attn.reshape(g.n * g.max_q, -1, head_dim)
        out.index_copy_(0, g.out_rows, rows if g.real is None else rows[g.real])
    return out


def expeditor_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, tokens, head_dim], key/value [1, kv_heads, tokens, head_dim]."""
    meta: StepMetadata | None = kwargs.get("expeditor_meta")
    if meta is None:
        raise RuntimeError("expeditor attention called without expeditor_meta")
    key_cache, value_cache = meta.layer_caches[module.layer_idx]  # type: ignore[index]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    if use_triton(q, key_cache):
        store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = paged_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scaling,
        )
        return out.unsqueeze(0), None
    plan = meta.cpu_plan
    if plan is None:
        check_attention_args(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc
        )
        plan = meta.cpu_plan = plan_cpu_step(meta, q, key_cache)
    if plan.store_index is not None:
        if k.dtype != key_cache.dtype or k.device != key_cache.device:
            store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        elif plan.store_tokens is None:
            key_cache.index_put_(plan.store_index, k)
            value_cache.index_put_(plan.store_index, v)
        else:
            key_cache.index_put_(plan.store_index, k.index_select(0, plan.store_tokens))
            value_cache.index_put_(plan.store_index, v.index_select(0, plan.store_tokens))
    return attend_cpu(plan, q, key_cache, value_cache, scaling).unsqueeze(0), None


def register() -> str:
    """Register the attention implementation (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, expeditor_attention)
    return ATTN_IMPLEMENTATION
