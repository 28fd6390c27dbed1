"""The quantized KV cache (``kv_cache_dtype``): 8-bit K/V with a scale per token and head.

Each stored K or V row of one KV head (``head_dim`` values) is kept as ``head_dim``
8-bit codes and one float16 scale: ``x ~ code * scale`` with ``scale = max|x| / QMAX``,
so the row's largest value is exact up to the code's rounding and no outlier of another
token or head widens the step. The codes are int8 (rounded, in [-127, 127]), or fp8
e4m3 / e5m2 (the nearest float8, in [-448, 448] / [-57344, 57344]): what vLLM, SGLang
and llama.cpp call an fp8 or q8 cache, with dynamic scales instead of a calibrated
per-tensor one. A row is quantized once, when its token is stored, and never again:
later tokens do not move earlier tokens' scales.

In a block the codes of every layer come first (``[layers, 2, block_size, kv_heads,
head_dim]``), then the scales (``[layers, 2, block_size, kv_heads]``): a block is still
one contiguous run of bytes, which swap, copy-on-write and the host tier move as they
are. A block takes ``head_dim + 2`` bytes per row instead of ``2 * head_dim`` (bfloat16)
or ``4 * head_dim`` (float32): 1.94x the tokens per byte of a 16-bit cache at head_dim
64, 1.97x at 128.

Every backend attends over the dequantized rows (float32 products of code and scale,
in the queries' dtype): the rows a step has just stored too, so a prompt's result does
not depend on how it was chunked.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KV_CACHE_DTYPES", "QMAX", "SCALE_DTYPE", "dequantize", "kv_storage_dtype", "quantize"]

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""``kv_cache_dtype`` values that quantize, and their codes' dtype (``auto``: none)."""
QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}
"""The largest code of each dtype: a row's absolute maximum maps to it."""
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0**-24
"""The smallest positive float16: an all-zero row keeps a finite, nonzero scale."""


def kv_storage_dtype(name: str) -> torch.dtype | None:
    """The codes' dtype of a ``kv_cache_dtype`` setting (None for ``auto``: K/V stored in
    the model's dtype)."""
    if name == "auto":
        return None
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        known = ", ".join(["auto", *KV_CACHE_DTYPES])
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {known}") from None


def quantize(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x`` [..., head_dim] -> (codes in ``dtype``, the same shape; float16 scales
    [...]), each row scaled by its own absolute maximum."""
    qmax = QMAX[dtype]
    wide = x.float()
    scale = (wide.abs().amax(-1) / qmax).clamp_(min=MIN_SCALE).to(SCALE_DTYPE)
    scaled = wide / scale.float()[..., None]  # by the stored scale: decoding agrees
    if dtype == torch.int8:
        codes = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = scaled.clamp_(-qmax, qmax).to(dtype)
    return codes, scale


def dequantize(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``codes`` [..., head_dim] (any 8-bit code dtype) times their ``scale`` [...], in
    ``dtype``."""
    return (codes.float() * scale.float()[..., None]).to(dtype)
