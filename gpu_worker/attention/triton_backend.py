"""The Triton backend: the kernels of :mod:`gpu_worker.kernels` (CUDA; CPU tensors under
``TRITON_INTERPRET=1`` in tests).

Its plan is the step's :class:`~gpu_worker.kernels.attention_schedule.AttentionSchedule`
(decode tiles, prefill tiles, split-KV decodes), made from the host arrays before they
reach the device and sent in one non-blocking copy, so no layer waits for the device. A
plan for a captured CUDA graph has no split-KV decodes (their launches depend on the
lengths), and a step that would take them runs eagerly. Over a quantized cache
(:mod:`gpu_worker.kv_quant`) a layer quantizes its new rows in torch (no host sync, so
graphs capture it), stores codes and scales with the same store kernel, and the
attention kernels multiply each loaded code tile by its rows' scales.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from gpu_worker.attention import AttentionBackend, StepArrays, StepMetadata
from gpu_worker.kernels.attention_args import AttentionParams
from gpu_worker.kernels.attention_schedule import (
    INTERPRET,
    AttentionSchedule,
    plan_attention,
    split_decodes,
)
from gpu_worker.kernels.paged_attention import launch_paged_attention
from gpu_worker.kernels.store_kv import store_kv_triton
from gpu_worker.kernels.warmup import warm_up
from gpu_worker.kv_quant import quantize

__all__ = ["TritonBackend", "unusable"]


def unusable(device: torch.device) -> str | None:
    """Why Triton cannot run attention on ``device``, or None."""
    if device.type == "cuda" or (device.type == "cpu" and INTERPRET):
        return None
    return f"no Triton for {device.type} tensors (CPU tensors need TRITON_INTERPRET=1)"


class TritonBackend(AttentionBackend):
    name = "triton"
    capturable = True

    def plan(
        self, arrays: StepArrays, num_blocks: int, *, capture: bool = False
    ) -> AttentionSchedule:
        kv_heads = self.layout.num_kv_heads
        return plan_attention(
            arrays["query_start_loc"],
            arrays["seq_lens"],
            num_kv_heads=kv_heads,
            queries_per_kv=self.num_heads // kv_heads,
            head_dim=self.layout.head_dim,
            block_size=self.layout.block_size,
            num_sms=0 if capture else None,
            device=self.device,
        )

    def graph_runs(self, arrays: StepArrays) -> bool:
        """No split-KV decodes on this GPU (a graph's launches are fixed)."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        q_lens = np.diff(arrays["query_start_loc"])
        kv_heads = self.layout.num_kv_heads
        return not split_decodes(
            q_lens, arrays["seq_lens"], num_kv_heads=kv_heads, num_sms=sms
        ).any()

    def forward(
        self, meta: StepMetadata, layer: int, q: Tensor, k: Tensor, v: Tensor, p: AttentionParams
    ) -> Tensor:
        key_cache, value_cache = meta.layer_caches[layer]
        scales = None if meta.layer_scales is None else meta.layer_scales[layer]
        if scales is not None:  # codes, and their scales as rows of one value
            (k, k_scale), (v, v_scale) = (quantize(x, key_cache.dtype) for x in (k, v))
            key_scale, value_scale = (x[..., None] for x in scales)
            store_kv_triton(
                k_scale[..., None], v_scale[..., None], key_scale, value_scale, meta.slot_mapping
            )
        store_kv_triton(k, v, key_cache, value_cache, meta.slot_mapping)
        tables = (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        return launch_paged_attention(  # attend checked the arguments
            q, key_cache, value_cache, *tables, p.scale, p.window, p.softcap, meta.plan, scales
        )

    def warm_up(self, layer_kinds: Iterable[tuple[int | None, float | None]]) -> None:
        warm_up(self.layout, num_heads=self.num_heads, device=self.device, layer_kinds=layer_kinds)
