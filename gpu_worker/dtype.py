"""The dtype a worker computes in: ``--dtype auto|float32|bfloat16|float16``.

``auto`` is bfloat16 on CUDA, and on a CPU whose instruction set has bfloat16 arithmetic
(AVX-512 BF16 or AMX, read from ``/proc/cpuinfo``; oneDNN then runs bf16 matmuls at
several times float32's rate) unless ``EXPEDITOR_CPU_BF16=0`` says not to (the tests set
it: their oracle is exact in float32), else float32. Read once, at worker start-up.
Weights and the KV cache take the dtype; the sampler computes in float32 whatever the
logits' dtype.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["DTYPES", "cpu_bf16_features", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU feature flags that give bfloat16 arithmetic."""


@functools.cache
def cpu_bf16_features() -> tuple[str, ...]:
    """Which of :data:`BF16_FLAGS` this machine's CPU has (empty: none, or no cpuinfo)."""
    info = Path("/proc/cpuinfo")
    try:
        flags = next(
            (line.split(":", 1)[1].split() for line in info.read_text().splitlines()
             if line.startswith("flags")),
            [],
        )  # fmt: skip
    except OSError:
        return ()
    return tuple(f for f in BF16_FLAGS if f in flags)


def resolve_dtype(
    name: str, device: torch.device, env: Mapping[str, str] = os.environ
) -> tuple[torch.dtype, str]:
    """The torch dtype of setting ``name`` on ``device``, and why (the worker logs it)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
        return DTYPES[name], f"dtype={name}"
    if device.type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    if env.get("EXPEDITOR_CPU_BF16") == "0":
        return torch.float32, "auto: EXPEDITOR_CPU_BF16=0"
    features = cpu_bf16_features()
    if features and torch.backends.mkldnn.is_available():
        return torch.bfloat16, f"auto: the CPU has {' and '.join(features)}"
    return torch.float32, "auto: the CPU has no bfloat16 arithmetic (AVX-512 BF16, AMX)"
