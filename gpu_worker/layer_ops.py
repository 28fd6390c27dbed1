"""A decoder layer's elementwise operations, for the lean forward
(:mod:`gpu_worker.lean_model`): the residual add with RMSNorm, the rotary embedding,
and the SiLU-gated product.

:class:`TorchOps` runs them as transformers' model code does, operation for operation
(RMSNorm in float32 as ``pow -> mean -> rsqrt``, ``q * cos + rotate_half(q) * sin``,
``silu(gate) * up``), on every device and dtype: the float32 forward stays exact
against transformers, and CUDA graphs capture it. On a CPU in bfloat16 those are some
twenty torch operations a layer over 64-576 wide rows, each a few microseconds of
dispatch and a float32 copy or two (SmolLM2, 64 decodes: about 8 of a 64 ms forward).
:class:`NativeOps` computes each group in one pass in C (``kernels/layer_ops_cpu.c``,
built with the attention kernel by :mod:`gpu_worker.kernels.native_build`): the same
float32 arithmetic on the widened bf16 values, rounded to bf16 wherever torch rounds,
so the results are torch's bit for bit but for the order RMSNorm sums its squares in
(tested). :func:`choose_ops` picks once per decoder.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.kernels.native_build import library

__all__ = ["NativeOps", "Norm", "TorchOps", "choose_ops", "rms_norm"]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(slots=True)
class Norm:
    """An RMSNorm's weight and epsilon."""

    weight: Tensor
    eps: float


def rms_norm(x: Tensor, norm: Norm) -> Tensor:
    """transformers' RMSNorm, operation for operation (in float32, back to x's dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * x.to(dtype)


class TorchOps:
    """The operations in torch, as transformers runs them."""

    name = "torch"

    def add_rms_norm(self, x: Tensor, add: Tensor | None, norm: Norm) -> tuple[Tensor, Tensor]:
        """``x + add`` (``add`` None: ``x``) and its RMSNorm; x [rows, width]."""
        if add is not None:
            x = x + add
        return x, rms_norm(x, norm)

    def rotate(self, qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``qk`` [tokens, heads, head_dim] turned by the rotary embedding (``cos``,
        ``sin`` [tokens, 1, head_dim])."""
        half = qk.shape[-1] // 2
        turned = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        return qk * cos + turned * sin

    def silu_mul(self, gate_up: Tensor, width: int) -> Tensor:
        """``silu(gate) * up`` of ``gate_up`` [rows, 2 * width] (gate first)."""
        return F.silu(gate_up[:, :width]) * gate_up[:, width:]


class NativeOps(TorchOps):
    """The operations in C, for bfloat16 CPU tensors (``x`` is updated in place by
    :meth:`add_rms_norm` and ``qk`` by :meth:`rotate`; anything else: ``ValueError``)."""

    name = "native"

    def __init__(self, library: ctypes.CDLL) -> None:
        self._norm = library.expeditor_add_rms_norm_bf16
        self._norm.argtypes = [_P, _P, _P, _P, _I, _I, _F]
        self._rotary = library.expeditor_rotary_bf16
        self._rotary.argtypes = [_P, _I, _I, _I, _I, _P, _P]
        self._silu_mul = library.expeditor_silu_mul_bf16
        self._silu_mul.argtypes = [_P, _P, _I, _I]
        for function in (self._norm, self._rotary, self._silu_mul):
            function.restype = None

    def add_rms_norm(self, x: Tensor, add: Tensor | None, norm: Norm) -> tuple[Tensor, Tensor]:
        rows, width = x.shape
        _check(
            (x, (rows, width)), (norm.weight, (width,)), *([] if add is None else [(add, x.shape)])
        )
        out = torch.empty_like(x)
        added = 0 if add is None else add.data_ptr()
        self._norm(
            x.data_ptr(), added, norm.weight.data_ptr(), out.data_ptr(), rows, width, norm.eps
        )
        return x, out

    def rotate(self, qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        tokens, heads, head_dim = qk.shape
        _check((cos, (tokens, 1, head_dim)), (sin, (tokens, 1, head_dim)))
        if (
            qk.dtype != torch.bfloat16
            or qk.device.type != "cpu"
            or qk.stride()[1:] != (head_dim, 1)
            or qk.stride(0) < heads * head_dim
            or head_dim % 2
        ):
            raise ValueError("native rotate takes bf16 CPU q/k heads contiguous within a token")
        self._rotary(
            qk.data_ptr(), qk.stride(0), tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr()
        )
        return qk

    def silu_mul(self, gate_up: Tensor, width: int) -> Tensor:
        rows = gate_up.shape[0]
        _check((gate_up, (rows, 2 * width)))
        out = gate_up.new_empty(rows, width)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out


def _check(*tensors: tuple[Tensor, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` unless each tensor is contiguous bf16 on the CPU, of its shape."""
    for t, shape in tensors:
        if (
            t.dtype != torch.bfloat16
            or t.shape != shape
            or not t.is_contiguous()
            or t.device.type != "cpu"
        ):
            raise ValueError(
                "native layer operations take contiguous bf16 CPU tensors of shape "
                f"{tuple(shape)}: got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def choose_ops(
    dtype: torch.dtype, device: torch.device, env: Mapping[str, str] = os.environ
) -> tuple[TorchOps, str | None]:
    """The operations for a forward in ``dtype`` on ``device``, and what the log says
    of them: None where C is not for this dtype and device (float32, CUDA); else the C
    passes, or torch's and why (``EXPEDITOR_NATIVE_CPU=0``, as for the attention
    kernel, or no library). Read once, at load."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return TorchOps(), None
    if env.get("EXPEDITOR_NATIVE_CPU", "1") == "0":
        return TorchOps(), "layer operations in torch (EXPEDITOR_NATIVE_CPU=0)"
    loaded = library()
    if isinstance(loaded, str):
        return TorchOps(), f"layer operations in torch (no native library: {loaded})"
    return NativeOps(loaded.cdll), "bf16 layer operations in C"
