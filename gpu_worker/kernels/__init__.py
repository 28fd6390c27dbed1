"""The worker's Triton kernels, each with a torch reference of the same signature.

KV cache layout: one device tensor ``kv_cache`` of shape
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (2 = key, value), so a
block (every layer, K and V) is contiguous and a swap is one contiguous copy per block. A
layer's caches are strided, non-contiguous views, ``key_cache = kv_cache[:, layer, 0]`` and
``value_cache = kv_cache[:, layer, 1]``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``; the kernels take them with their strides. A slot is
``block_id * block_size + offset``.

The block copies (``copy_blocks``, ``gather_blocks``, ``scatter_blocks``) dispatch to
``<name>_triton`` for CUDA tensors, else to ``<name>_ref``. Attention and the K/V store
are the attention backends' (:mod:`gpu_worker.attention`): the Triton backend calls
``store_kv_triton`` and ``paged_attention_triton`` with the step's
:class:`AttentionSchedule` (:func:`plan_attention`: decode tiles, prefill tiles,
split-KV decodes for long contexts, planned once per step on the host), and
:func:`warm_up` compiles their variants at start-up.
"""

from gpu_worker.kernels.attention_schedule import AttentionSchedule, plan_attention
from gpu_worker.kernels.block_copy import (
    copy_blocks,
    copy_blocks_ref,
    copy_blocks_triton,
    gather_blocks,
    gather_blocks_ref,
    gather_blocks_triton,
    scatter_blocks,
    scatter_blocks_ref,
    scatter_blocks_triton,
)
from gpu_worker.kernels.paged_attention import paged_attention_triton
from gpu_worker.kernels.store_kv import store_kv_ref, store_kv_triton
from gpu_worker.kernels.warmup import warm_up

__all__ = [
    "AttentionSchedule",
    "copy_blocks",
    "copy_blocks_ref",
    "copy_blocks_triton",
    "gather_blocks",
    "gather_blocks_ref",
    "gather_blocks_triton",
    "paged_attention_triton",
    "plan_attention",
    "scatter_blocks",
    "scatter_blocks_ref",
    "scatter_blocks_triton",
    "store_kv_ref",
    "store_kv_triton",
    "warm_up",
]
