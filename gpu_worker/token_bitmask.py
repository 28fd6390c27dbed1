"""Structured output on the worker: the plan's token bitmasks applied to the logits.

A constrained row's mask is ``ceil(vocab / 32)`` little-endian int32 words (bit
``t % 32`` of word ``t // 32`` set = token ``t`` allowed), made by the scheduler's
matcher (``scheduler_svc/structured_output.py``). The masks of a step go to the device
in its one host-to-device copy; the bits are unpacked there and every disallowed logit
becomes ``-inf`` before the sampler, so greedy and random picks, penalties and
logprobs all see the constrained distribution. Token ids at or past ``32 * words``
(padding rows of the embedding) are disallowed.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["apply_bitmask", "pack_rows"]


def pack_rows(masks: list[bytes | None], words: int) -> tuple[np.ndarray, np.ndarray]:
    """(row indices, ``[rows, words]`` int32 words) of the rows that have a mask."""
    rows = [r for r, mask in enumerate(masks) if mask is not None]
    bits = np.frombuffer(b"".join(m for m in masks if m is not None), dtype="<i4")
    return np.asarray(rows, dtype=np.int64), bits.reshape(len(rows), words).astype(np.int32)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``logits`` (``[R, V]``) with the tokens ``bits`` (``[len(rows), W]`` int32)
    disallows in ``rows`` set to ``-inf``; a new tensor."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)  # [rows, 32 * W]
    width = allowed.shape[1]
    if width < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - width, dtype=torch.bool, device=bits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    sub = logits.index_select(0, rows).masked_fill(~allowed[:, :vocab], -torch.inf)
    return logits.index_copy(0, rows, sub)
