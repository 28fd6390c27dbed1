"""Write new tokens' K/V into their paged-cache slots."""

# Triton kernel parameters stay unannotated: Triton reads annotations for specialisation.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must be [tokens, kv_heads, head_dim], got {key.shape}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"caches must be [blocks, block_size, kv_heads, head_dim], got {key_cache.shape}"
        )
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {key_cache.shape[2:]} != key {key.shape[1:]}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference: ``cache[slot // bs, slot % bs] = kv`` for every slot >= 0."""
    _check_store_args(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    valid = slots >= 0
    slots = slots[valid]
    blocks = slots // block_size
    offsets = slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.device)[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.device)[valid].to(value_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_s0,
    k_s1,
    k_s2,
    v_s0,
    v_s1,
    v_s2,
    kc_s0,
    kc_s1,
    kc_s2,
    kc_s3,
    vc_s0,
    vc_s1,
    vc_s2,
    vc_s3,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # One program per token: copy its [kv_heads, head_dim] K and V tiles.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    k = tl.load(key_ptr + token * k_s0 + heads[:, None] * k_s1 + dims[None, :] * k_s2, mask=mask)
    v = tl.load(value_ptr + token * v_s0 + heads[:, None] * v_s1 + dims[None, :] * v_s2, mask=mask)
    kc = key_cache_ptr + block * kc_s0 + offset * kc_s1
    vc = value_cache_ptr + block * vc_s0 + offset * vc_s1
    tl.store(
        kc + heads[:, None] * kc_s2 + dims[None, :] * kc_s3,
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc + heads[:, None] * vc_s2 + dims[None, :] * vc_s3,
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`store_kv_ref` (strided key/value and cache views)."""
    _check_store_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slots,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
