"""expeditor's attention, registered with transformers' attention interface.

The model runs one packed forward per step: batch 1, every scheduled token side by side,
explicit ``position_ids`` and ``use_cache=False``. Each attention layer receives the
step's :class:`StepMetadata` as the keyword ``expeditor_meta``; it stores the new K/V
into their cache slots, then attends over the paged cache (the prompt chunks causally,
decodes over their whole context).

On CUDA (or with ``EXPEDITOR_FORCE_TRITON=1``) every layer calls the Triton kernels.
Elsewhere the first layer of a step builds a :class:`CpuStepPlan` from the metadata
(:mod:`gpu_worker.cpu_plan`) and every layer reuses it: the cache indices of the new
tokens, and per group of sequences
(:func:`~gpu_worker.kernels.cpu_attention.paged_attention_cpu`'s groups) the blocks to
gather, the stale rows to zero, the query rows, the attention mask and the views of the
buffers it gathers into. A layer then does only its stores, copies and one SDPA call per
group: ``paged_attention_cpu``'s operations, except that groups of whole prompts use
SDPA's own causal mask and groups of few query rows (decodes) fold the query heads of
each KV head into the rows of one head, which reads each K/V row once for all of them.
When the metadata carries the worker's :class:`DecodeReuse` and a decode step's
sequences are the last step's, one token further, each layer keeps the K/V it gathered
last step and only adds the new tokens' rows. All give the same values up to float
rounding (tests/kernels/test_attention_plan.py).

A layer with a sliding window or attention-logit soft-capping (the ``sliding_window``
and ``softcap`` keywords transformers passes, per layer) gives both to the Triton
kernel; on the CPU path it stores through the plan and attends with
:func:`~gpu_worker.kernels.cpu_attention.paged_attention_cpu`, which implements them
(the plan's groups and their reuse do not).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from gpu_worker.cpu_plan import (
    CpuGroup,
    CpuStepPlan,
    DecodeReuse,
    GroupBuffers,
    StepMetadata,
    plan_cpu_step,
)
from gpu_worker.kernels import paged_attention, store_kv, use_triton
from gpu_worker.kernels.cpu_attention import check_attention_args, paged_attention_cpu
from gpu_worker.kernels.cpu_native import (
    check_step,
    native_kernels,
    plan_native_step,
    supports,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CpuGroup",
    "CpuStepPlan",
    "DecodeReuse",
    "GroupBuffers",
    "StepMetadata",
    "attend",
    "attend_cpu",
    "expeditor_attention",
    "plan_cpu_step",
    "register",
]

ATTN_IMPLEMENTATION = "expeditor_paged"


def attend_cpu(
    plan: CpuStepPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    layer: int = 0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention_cpu`` over the planned groups: ``query`` [tokens, heads,
    head_dim] -> the same shape (a view of the attention's output when one group takes
    every row in order). ``key``/``value``: the step's new K/V [tokens, kv_heads,
    head_dim], which a plan that keeps the gathered K/V across steps adds to them."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    heads = query.shape[1]
    out: torch.Tensor | None = None
    for g in plan.groups:
        buf = g.buffers[layer if len(g.buffers) > 1 else 0]
        if g.new_rows is None:
            torch.index_select(key_cache, 0, g.blocks, out=buf.k_out)
            torch.index_select(value_cache, 0, g.blocks, out=buf.v_out)
            if g.stale is not None:
                buf.gathered.index_fill_(0, g.stale, 0.0)
        else:
            if key is None or value is None:
                raise ValueError("a plan that keeps the gathered K/V needs the new K/V")
            new_k = key if g.rows is None else key.index_select(0, g.rows)
            new_v = value if g.rows is None else value.index_select(0, g.rows)
            buf.gathered.index_copy_(0, g.new_rows[0], new_k)
            buf.gathered.index_copy_(0, g.new_rows[1], new_v)
        q = query if g.rows is None else query.index_select(0, g.rows)
        if g.fold and g.max_q == 1:
            # [n, kv_heads, heads per KV head, head_dim]: the query heads of a KV head
            # are the rows of one head (GQA's head order), and so are the outputs.
            q = q.reshape(g.n, num_kv_heads, -1, head_dim)
            attn = F.scaled_dot_product_attention(q, buf.k, buf.v, attn_mask=g.mask, scale=scale)
            rows = attn.reshape(g.n, heads, head_dim)
        elif g.fold:
            # [n, kv_heads, max_q * heads per KV head, head_dim]: row i * per + j is
            # query row i of head kv_head * per + j.
            q = q.view(g.n, g.max_q, num_kv_heads, -1, head_dim).transpose(1, 2)
            q = q.reshape(g.n, num_kv_heads, -1, head_dim)
            attn = F.scaled_dot_product_attention(q, buf.k, buf.v, attn_mask=g.mask, scale=scale)
            attn = attn.view(g.n, num_kv_heads, g.max_q, -1, head_dim).transpose(1, 2)
            rows = attn.reshape(g.n * g.max_q, heads, head_dim)
        else:
            attn = F.scaled_dot_product_attention(
                q.view(g.n, g.max_q, heads, head_dim).transpose(1, 2),
                buf.k,
                buf.v,
                attn_mask=g.mask,
                is_causal=g.causal,
                scale=scale,
                enable_gqa=True,
            )  # [n, heads, max_q, head_dim]
            rows = attn.transpose(1, 2).reshape(g.n * g.max_q, heads, head_dim)
        if g.out_rows is None:
            return rows
        if out is None:
            out = torch.empty_like(query) if plan.covers_all else torch.zeros_like(query)
        out.index_copy_(0, g.out_rows, rows if g.real is None else rows[g.real])
    return torch.zeros_like(query) if out is None else out


def attend(
    meta: StepMetadata,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's attention over the paged cache: store the step's new K/V, then attend.
    ``q`` [tokens, heads, head_dim], ``k``/``v`` [tokens, kv_heads, head_dim] (views
    will do) -> [tokens, heads, head_dim]."""
    key_cache, value_cache = meta.layer_caches[layer]
    plan = meta.cpu_plan
    paged = (q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    if plan is None and use_triton(q, key_cache):
        store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        return paged_attention(
            *paged, scaling, window=window, softcap=softcap, schedule=meta.attention_schedule
        )
    native = native_kernels() if plan is None else None
    if native is not None and supports(q, key_cache, value_cache):
        step = meta.native_step
        if step is None:
            check_attention_args(*paged)
            check_step(
                q,
                key_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.slot_mapping,
            )
            step = meta.native_step = plan_native_step(
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                key_cache.shape[1],
                q.shape[0],
            )
        if k.dtype == key_cache.dtype and k.stride(2) == 1 and v.stride(2) == 1:
            native.store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        else:
            store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        return step.attend(native, q, k, v, *paged[1:], scaling, window or 0, softcap or 0.0)
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
    if window is not None or softcap is not None:
        return paged_attention_cpu(*paged, scaling, window=window, softcap=softcap)
    return attend_cpu(plan, q, key_cache, value_cache, scaling, layer, k, v)


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
    """transformers' attention interface over :func:`attend`: query [1, heads, tokens,
    head_dim], key/value [1, kv_heads, tokens, head_dim]."""
    meta: StepMetadata | None = kwargs.get("expeditor_meta")
    if meta is None:
        raise RuntimeError("expeditor attention called without expeditor_meta")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    layer: int = module.layer_idx  # type: ignore[assignment]
    window: int | None = kwargs.get("sliding_window") or None
    softcap: float | None = kwargs.get("softcap") or None
    return attend(meta, layer, q, k, v, scaling, window, softcap).unsqueeze(0), None


def register() -> str:
    """Register the attention implementation (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, expeditor_attention)
    return ATTN_IMPLEMENTATION
