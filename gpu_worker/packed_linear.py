"""Linear weights reordered once for oneDNN: a bfloat16 model's projections on a CPU.

On a CPU torch runs a bf16 ``F.linear`` through oneDNN, which lays the weight out in
its own blocked format (the one its AMX and AVX-512 BF16 kernels read) on every call:
the weight is read, written again reordered, then read by the product. A small model's
decode step is bound by reading its weights, so that costs most of a matmul's time.
:func:`pack` does the reordering once, at load (torch's ``mkldnn._reorder_linear_weight``,
the op inductor's CPU freezing uses; the result is an opaque oneDNN tensor), and
:func:`linear` multiplies by either kind of weight. The products are F.linear's up to
the order oneDNN sums in: at SmolLM2's shapes on an AMX CPU they are equal bit for bit
(tested), elsewhere a product may differ in its last bf16 bit (seen at a 2048 x 11008
weight at one row, and at a few row counts where the CPU has no bf16 instructions),
as F.linear's own results move with the thread count. :func:`why_not_packed` checks
once per process, on a probe, that the products agree to bf16's rounding; float32 is
never packed (oneDNN's float32 products differ from the dense path's in the last bits,
which the exact float32 oracle would see).

Measured on SmolLM2-135M in bf16, 64 decodes at context 250 (docs/benchmarks.md,
"Weights reordered once"): the forward 72-75 -> 66 ms, served 1.07-1.10x the tokens/s.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["linear", "pack", "why_not_packed"]

ROWS_HINT = 64
"""The batch rows oneDNN is told to expect when it picks the layout (any count works)."""
BF16_RTOL = 2**-7
"""How far a packed product may be from F.linear's: two units of bf16's last place."""


@functools.cache
def _probe() -> str | None:
    """Why packing is unavailable in this process, or None once a probe agreed with
    F.linear."""
    if not torch.backends.mkldnn.is_available():
        return "torch has no oneDNN (mkldnn)"
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    try:
        packed = pack(weight)
        for rows in (1, 5, 64, 130):
            x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
            got, want = linear(x, packed, bias).float(), F.linear(x, weight, bias).float()
            if not torch.allclose(got, want, rtol=BF16_RTOL, atol=BF16_RTOL):
                return "oneDNN's products with a reordered weight are not F.linear's"
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        return f"oneDNN cannot reorder weights here ({exc})"
    return None


def why_not_packed(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when weights of ``dtype`` on ``device`` are packed, else why not."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return f"{dtype} on {torch.device(device).type} (packed: bfloat16 on a CPU)"
    return _probe()


def pack(weight: Tensor) -> Tensor:
    """``weight`` [out, in] reordered into oneDNN's layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [rows, in], whether ``weight`` is dense or
    :func:`pack`'s."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
