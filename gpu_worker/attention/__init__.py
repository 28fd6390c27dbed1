"""expeditor's attention: one backend per worker, behind one interface.

The model runs one packed forward per step: batch 1, every scheduled token side by side,
explicit positions, no transformers cache. Attention is an :class:`AttentionBackend`
(the shape of vLLM v1's backends and mini-sglang's ``BaseAttnBackend``): the runner
calls its :meth:`~AttentionBackend.plan` once per step, on the host arrays of the step
(before they reach the device), and puts the result into the step's
:class:`StepMetadata`; every layer then calls :func:`attend` (the lean forward) or
:func:`expeditor_attention` (transformers' modules, through the attention interface
registered as :data:`ATTN_IMPLEMENTATION`), which hands the layer's q, k, v to the
backend's :meth:`~AttentionBackend.forward`: store the new K/V in their cache slots,
then attend over the paged cache. Every backend implements the whole contract: mixed
batches of decodes and prompt chunks (row i of a sequence with L keys and n new rows
sits at position L - n + i and sees keys k <= position), GQA, a per-layer sliding
window (keys k > position - window) and soft-capping (scores become
``softcap * tanh(score / softcap)``). Rows outside every sequence (the runner makes
none) are zero on the CPU backends, unspecified on Triton.

The backends, one module each, with its design: ``triton`` (:mod:`.triton_backend`,
CUDA), ``native`` (:mod:`.native_backend`, a C kernel for float32 CPU workers) and
``torch`` (:mod:`.torch_backend`, plain torch: the fallback, and the reference every
other backend is tested against).

:func:`choose_backend` picks one at worker start-up from the device, the dtype and what
the machine has, and says why; nothing in the step path reads the environment.
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
from transformers import AttentionInterface

from gpu_worker.kernels.attention_args import AttentionParams, check_args, layer_params

if TYPE_CHECKING:
    from gpu_worker.kernels.warmup import CacheLayout  # the KV layout (kv_cache.KVLayout)

ATTN_IMPLEMENTATION = "expeditor_paged"
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
    """transformers' attention interface over :func:`attend`: query [1, heads, tokens,
    head_dim], key/value [1, kv_heads, tokens, head_dim]."""
    meta: StepMetadata | None = kwargs.get("expeditor_meta")
    if meta is None:
        raise RuntimeError("expeditor attention called without expeditor_meta")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    layer: int = module.layer_idx  # type: ignore[assignment]
    window = kwargs.get("sliding_window") or None
    softcap = kwargs.get("softcap") or None
    return attend(meta, layer, q, k, v, layer_params(scaling, window, softcap)).unsqueeze(0), None


def register() -> str:
    """Register the attention implementation with transformers (idempotent); its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, expeditor_attention)
    return ATTN_IMPLEMENTATION


def choose_backend(
    device: torch.device, layout: CacheLayout, num_heads: int, env: Mapping[str, str] = os.environ
) -> tuple[AttentionBackend, str]:
    """The worker's backend and why (logged): Triton on CUDA (or anywhere with
    ``EXPEDITOR_FORCE_TRITON=1``, on CPU tensors under ``TRITON_INTERPRET=1``), the
    native kernel for float32 and bfloat16 on a CPU (an int8 cache too) unless
    ``EXPEDITOR_NATIVE_CPU=0``, the kernel's limits (no fp8 cache) or a failed build say
    otherwise, else torch. Read once, at start-up."""
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
