"""Whole-block copies of the KV cache: copy-on-write (copy_blocks) and swap
(gather_blocks / scatter_blocks). A block, ``kv_cache[b]``, is one contiguous row of
``kv_cache[0].numel()`` elements.
"""

# Triton kernel parameters stay unannotated: Triton reads annotations for specialisation.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COPY_BLOCK = 1024


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() < 2 or not kv_cache[0].is_contiguous():
        raise ValueError("kv_cache blocks (kv_cache[b]) must each be contiguous")


def _as_ids(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    return ids.to(device=device, dtype=torch.int64).contiguous()


# ---------------------------------------------------------------- references


def copy_blocks_ref(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Torch reference: ``kv_cache[dst] = kv_cache[src]`` for each (src, dst) row of
    ``pairs`` [n, 2] (all layers, K and V; sources and destinations distinct)."""
    if pairs.numel() == 0:
        return
    pairs = _as_ids(pairs, kv_cache.device).reshape(-1, 2)
    kv_cache[pairs[:, 1]] = kv_cache[pairs[:, 0]]


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference: contiguous ``[n, *kv_cache.shape[1:]]`` copy of the blocks."""
    return kv_cache.index_select(0, _as_ids(block_ids, kv_cache.device)).contiguous()


def scatter_blocks_ref(src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Torch reference: ``kv_cache[block_ids[i]] = src[i]``."""
    if block_ids.numel() == 0:
        return
    ids = _as_ids(block_ids, kv_cache.device)
    kv_cache[ids] = src.to(device=kv_cache.device, dtype=kv_cache.dtype)


# ---------------------------------------------------------------- Triton


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_row_stride,
    dst_row_stride,
    ids_stride,
    row_numel,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program (i, j) copies chunk j of row i: dst[dst_row(i)] <- src[src_row(i)], where a
    # row is addressed through an id array when *_INDEXED, else it is row i itself.
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    if SRC_INDEXED:
        src_row = tl.load(src_ids_ptr + i * ids_stride).to(tl.int64)
    else:
        src_row = i
    if DST_INDEXED:
        dst_row = tl.load(dst_ids_ptr + i * ids_stride).to(tl.int64)
    else:
        dst_row = i
    x = tl.load(src_ptr + src_row * src_row_stride + offs, mask=mask)
    tl.store(dst_ptr + dst_row * dst_row_stride + offs, x, mask=mask)


def _launch_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | None,
    dst_ids: torch.Tensor | None,
    ids_stride: int,
    num_rows: int,
) -> None:
    row_numel = dst[0].numel()
    ids = src_ids if src_ids is not None else dst_ids
    assert ids is not None
    grid = (num_rows, triton.cdiv(row_numel, _COPY_BLOCK))
    _copy_rows_kernel[grid](
        src,
        dst,
        src_ids if src_ids is not None else ids,
        dst_ids if dst_ids is not None else ids,
        src.stride(0),
        dst.stride(0),
        ids_stride,
        row_numel,
        SRC_INDEXED=src_ids is not None,
        DST_INDEXED=dst_ids is not None,
        BLOCK=_COPY_BLOCK,
    )


def copy_blocks_triton(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Triton version of :func:`copy_blocks_ref`."""
    _check_cache(kv_cache)
    if pairs.numel() == 0:
        return
    pairs = _as_ids(pairs, kv_cache.device).reshape(-1, 2)
    # pairs is contiguous [n, 2]: src ids at pairs_ptr + 2i, dst ids at pairs_ptr + 2i + 1.
    _launch_copy(kv_cache, kv_cache, pairs[:, 0], pairs[:, 1], 2, pairs.shape[0])


def gather_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gather_blocks_ref`."""
    _check_cache(kv_cache)
    ids = _as_ids(block_ids, kv_cache.device).reshape(-1)
    out = torch.empty(
        (ids.numel(), *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device
    )
    if ids.numel() > 0:
        _launch_copy(kv_cache, out, ids, None, 1, ids.numel())
    return out


def scatter_blocks_triton(
    src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor
) -> None:
    """Triton version of :func:`scatter_blocks_ref`."""
    _check_cache(kv_cache)
    ids = _as_ids(block_ids, kv_cache.device).reshape(-1)
    if ids.numel() == 0:
        return
    if src.shape != (ids.numel(), *kv_cache.shape[1:]):
        raise ValueError(f"src shape {tuple(src.shape)} does not match {ids.numel()} blocks")
    src = src.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous()
    _launch_copy(src, kv_cache, None, ids, 1, ids.numel())


# ---------------------------------------------------------------- dispatchers


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks within ``kv_cache``: ``pairs`` int64 [n, 2] of (src, dst)."""
    if kv_cache.is_cuda:
        copy_blocks_triton(kv_cache, pairs)
    else:
        copy_blocks_ref(kv_cache, pairs)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Contiguous ``[n, *kv_cache.shape[1:]]`` copy of blocks ``block_ids`` (swap out)."""
    if kv_cache.is_cuda:
        return gather_blocks_triton(kv_cache, block_ids)
    return gather_blocks_ref(kv_cache, block_ids)


def scatter_blocks(src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write ``src[i]`` into block ``block_ids[i]`` of ``kv_cache`` (swap in)."""
    if kv_cache.is_cuda:
        scatter_blocks_triton(src, kv_cache, block_ids)
    else:
        scatter_blocks_ref(src, kv_cache, block_ids)
