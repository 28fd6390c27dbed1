"""expeditor's attention: one :class:`AttentionBackend` per worker, chosen at start-up by
:func:`choose_backend` (docs/architecture.md, "Attention", has the design and the
backends: :mod:`.triton_backend`, :mod:`.native_backend`, :mod:`.torch_backend`).

The contract every backend implements: a step is one packed batch, every scheduled token
side by side; :meth:`~AttentionBackend.plan` runs once per step on its host arrays,
:meth:`~AttentionBackend.forward` once per layer through :func:`attend` (transformers'
modules through :func:`gpu_worker.decoder.expeditor_attention`): store the new K/V in
their slots, then attend over the paged cache. Mixed batches of decodes and prompt chunks (row
i of a sequence with L keys and n new rows sits at position L - n + i and sees keys k <=
position), GQA, a per-layer sliding window (keys k > position - window) and
soft-capping (scores become ``softcap * tanh(score / softcap)``). Rows outside every
sequence (the runner makes none) are zero on the CPU backends, unspecified on Triton.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from gpu_worker.kernels.attention_args import AttentionParams, check_args

if TYPE_CHECKING:
    from gpu_worker.kernels.warmup import CacheLayout  # the KV layout (kv_cache.KVLayout)

log = logging.getLogger("expeditor.worker")
StepArrays = Mapping[str, np.ndarray]
"""A step's host arrays (``StepInputs.host_arrays``): :class:`StepMetadata`'s first four
fields, in numpy (slot -1: not stored)."""


@dataclass(slots=True)
class StepMetadata:
    """One step's attention inputs, shared by every layer."""

    slot_mapping: torch.Tensor
    """[tokens] int64: cache slot (block * block_size + offset) of each new token."""
    block_tables: torch.Tensor
    """[seqs, width] int32."""
    seq_lens: torch.Tensor
    """[seqs] int32: keys after this step's tokens."""
    query_start_loc: torch.Tensor
    """[seqs + 1] int32: where each sequence's rows start in the packed batch."""
    layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer: (key cache, value cache) [blocks, block_size, kv_heads, head_dim] views
    (8-bit codes in a quantized cache)."""
    backend: AttentionBackend
    plan: Any
    """What ``backend.plan`` made of the step."""
    layer_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Per layer of a quantized cache (:mod:`gpu_worker.kv_quant`): (key, value) scales
    [blocks, block_size, kv_heads]; None when K/V are stored in the model's dtype."""
    checked: bool = False
    """The step's shapes passed ``check_args`` (its first layer checks them)."""
    groups: list[StepMetadata] | None = None
    """A cache of layer groups (:class:`gpu_worker.kv_cache.LayerGroups`): per group,
    its own tables, slots and plan (this one is the first group's)."""
    layer_groups: tuple[int, ...] = ()
    """With ``groups``: per layer, its group."""


class AttentionBackend:
    """A worker's attention: :meth:`plan` once per step, :meth:`forward` per layer."""

    name: ClassVar[str]
    capturable: ClassVar[bool] = False
    """Its plans (``capture=True``) serve every replay of a captured CUDA graph."""

    def __init__(self, layout: CacheLayout, num_heads: int, device: torch.device) -> None:
        self.layout, self.num_heads, self.device = layout, num_heads, torch.device(device)

    def plan(self, arrays: StepArrays, num_blocks: int, *, capture: bool = False) -> Any:
        """The step's per-step state, from its host arrays (never reads the device);
        ``num_blocks``: the cache's; ``capture``: for a graph's fixed launches."""
        raise NotImplementedError

    def forward(
        self, meta: StepMetadata, layer: int, q: Tensor, k: Tensor, v: Tensor, p: AttentionParams
    ) -> Tensor:
        """Store the layer's new ``k``/``v`` [tokens, kv_heads, head_dim], then attend:
        ``q`` [tokens, heads, head_dim] -> the same shape."""
        raise NotImplementedError

    def graph_runs(self, arrays: StepArrays) -> bool:
        """Whether a graph captured with a ``capture`` plan may run this step."""
        return self.capturable

    def warm_up(self, layer_kinds: Iterable[tuple[int | None, float | None]]) -> None:
        """Compile what the layers of these (window, softcap) kinds will run (if anything)."""


def attend(
    meta: StepMetadata, layer: int, q: Tensor, k: Tensor, v: Tensor, p: AttentionParams
) -> Tensor:
    """One layer's attention through the step's backend (views will do for q, k, v)."""
    if meta.groups is not None:  # the layer's group: its tables, slots and plan
        meta = meta.groups[meta.layer_groups[layer]]
    if not meta.checked:  # every layer's shapes are the first one's
        tables = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        check_args(q, *meta.layer_caches[layer], *tables)
        meta.checked = True
    return meta.backend.forward(meta, layer, q, k, v, p)


def choose_backend(
    device: torch.device, layout: CacheLayout, num_heads: int, env: Mapping[str, str] = os.environ
) -> tuple[AttentionBackend, str]:
    """The worker's backend and why (logged), from the device, the dtype, the machine and
    ``env`` (read here, once, at start-up)."""
    from gpu_worker.attention import native_backend, torch_backend

    device = torch.device(device)
    forced = env.get("EXPEDITOR_FORCE_TRITON") == "1"
    backend: AttentionBackend | None = None
    if forced or device.type == "cuda":
        from gpu_worker.attention import triton_backend

        why = triton_backend.unusable(device)
        if why is None:
            reason = "EXPEDITOR_FORCE_TRITON=1" if forced else "CUDA"
            backend = triton_backend.TritonBackend(layout, num_heads, device)
        else:
            reason = f"Triton unusable: {why}"
    elif env.get("EXPEDITOR_NATIVE_CPU", "1") == "0":
        reason = "EXPEDITOR_NATIVE_CPU=0"
    else:
        kernels, why = native_backend.load(device, layout, num_heads)
        if kernels is None:
            reason = f"no native kernel: {why}"
        else:
            reason = f"{kernels.path.name}: {', '.join(kernels.features) or 'plain C'}"
            backend = native_backend.NativeBackend(layout, num_heads, device, kernels)
    backend = backend or torch_backend.TorchBackend(layout, num_heads, device)
    log.info("attention: %s backend (%s)", backend.name, reason)
    return backend, reason
