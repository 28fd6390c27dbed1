"""expeditor's attention, registered with transformers' attention interface.

The model runs one packed forward per step: batch 1, every scheduled token of every
sequence side by side, explicit ``position_ids`` and ``use_cache=False``. Each
attention layer receives the step's :class:`StepMetadata` as the keyword
``expeditor_meta``; it stores the new K/V into their cache slots, then attends over the
paged cache (the prompt chunks causally, decodes over their whole context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from gpu_worker.kernels import paged_attention, store_kv

ATTN_IMPLEMENTATION = "expeditor_paged"


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
    store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache, meta.slot_mapping
    )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = paged_attention(
        query[0].transpose(0, 1),
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scaling,
    )
    return out.unsqueeze(0), None


def register() -> str:
    """Register the attention implementation (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, expeditor_attention)
    return ATTN_IMPLEMENTATION
