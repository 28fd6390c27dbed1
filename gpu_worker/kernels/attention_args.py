"""The arguments of paged attention, checked once where they enter: the shapes of a
step (:func:`check_args`, by every backend's first layer and the public kernel entry
points) and a layer's scale, window and soft-capping (:func:`layer_params`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "AttentionParams",
    "Scales",
    "check_args",
    "layer_kind",
    "layer_params",
    "scale_args",
]


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """What a layer's attention is, beyond its tensors (0: no window, no soft-capping)."""

    scale: float
    window: int
    softcap: float


@functools.lru_cache(maxsize=256, typed=True)  # typed: True and 1 differ
def layer_params(scale: float, window: int | None, softcap: float | None) -> AttentionParams:
    """A layer's parameters checked (once per kind: a model has a few)."""
    return AttentionParams(float(scale), *layer_kind(window, softcap))


def check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[int, float]:
    """Raise ``ValueError`` unless the shapes fit paged attention's; returns
    ``(window, softcap)`` with 0 for none (``window`` an int >= 1, ``softcap`` a finite
    float > 0, or None / 0)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"caches must be [blocks, block_size, kv_heads, head_dim], got {key_cache.shape}"
        )
    if key_cache.shape[3] != query.shape[2]:
        raise ValueError(f"cache head_dim {key_cache.shape[3]} != query {query.shape[2]}")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"num_heads {query.shape[1]} not a multiple of num_kv_heads")
    seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != seqs:
        raise ValueError(f"block_tables must be [{seqs}, max_blocks], got {block_tables.shape}")
    if query_start_loc.shape != (seqs + 1,):
        raise ValueError(f"query_start_loc must be [{seqs + 1}], got {query_start_loc.shape}")
    return layer_kind(window, softcap)


def layer_kind(window: int | None, softcap: float | None) -> tuple[int, float]:
    """A layer's ``(window, softcap)`` checked, 0 for none."""
    if window is None and softcap is None:
        return 0, 0.0
    if window is not None and not (_number(window, int) and window >= 0):
        raise ValueError(f"window must be an int >= 1 (or None/0 for none), got {window!r}")
    if softcap is not None and not (_number(softcap, float) and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be a finite float > 0 (or None), got {softcap!r}")
    return int(window or 0), float(softcap or 0.0)


def _number(value: object, kind: type) -> bool:
    """An int (numpy's too) for ``int``; also a float for ``float``; never a bool."""
    kinds = (int, np.integer) if kind is int else (int, float, np.integer, np.floating)
    return isinstance(value, kinds) and not isinstance(value, bool)


Scales = tuple[torch.Tensor, torch.Tensor]
"""A quantized cache's (key, value) scales of a layer, [blocks, block_size, kv_heads]."""


def scale_args(key_cache: torch.Tensor, scales: Scales | None) -> tuple[object, ...]:
    """The kernels' scale arguments: the two pointers and the strides they share (a
    cache in the model's dtype: the key cache twice, strides 0, never read)."""
    if scales is None:
        return key_cache, key_cache, 0, 0, 0
    key_scale, value_scale = scales
    if key_scale.shape != key_cache.shape[:3] or value_scale.stride() != key_scale.stride():
        raise ValueError(
            f"scales must be two [blocks, block_size, kv_heads] views with one layout, got "
            f"{tuple(key_scale.shape)} and {tuple(value_scale.shape)} for caches "
            f"{tuple(key_cache.shape)}"
        )
    return key_scale, value_scale, *key_scale.stride()
