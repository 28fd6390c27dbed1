"""The worker's kernels: each a Triton kernel plus a torch reference of the same signature.

KV cache layout: one device tensor ``kv_cache`` of shape
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (2 = key, value), so a
block (every layer, K and V) is contiguous and a swap is one contiguous copy per block. A
layer's caches are strided, non-contiguous views, ``key_cache = kv_cache[:, layer, 0]`` and
``value_cache = kv_cache[:, layer, 1]``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``; the kernels take them with their strides. A slot is
``block_id * block_size + offset``.

Each public function dispatches to ``<name>_triton`` when its tensors are on CUDA or the
environment sets ``EXPEDITOR_FORCE_TRITON=1`` (e.g. with ``TRITON_INTERPRET=1`` on CPU),
else to ``<name>_ref``; except ``paged_attention``, whose non-Triton path is the faster
``paged_attention_cpu`` (its reference stays the tests' oracle).

``paged_attention``'s Triton path runs a step's :class:`AttentionSchedule`, built once per
step on the host by :func:`plan_attention` (decode tiles, prefill tiles, split-KV decodes
for long contexts) and shared by every layer; :func:`warm_up` compiles its kernels'
variants at start-up.
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
from gpu_worker.kernels.cpu_attention import paged_attention_cpu
from gpu_worker.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)
from gpu_worker.kernels.store_kv import store_kv, store_kv_ref, store_kv_triton, use_triton
from gpu_worker.kernels.warmup import warm_up

__all__ = [
    "AttentionSchedule",
    "copy_blocks",
    "copy_blocks_ref",
    "copy_blocks_triton",
    "gather_blocks",
    "gather_blocks_ref",
    "gather_blocks_triton",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_ref",
    "paged_attention_triton",
    "plan_attention",
    "scatter_blocks",
    "scatter_blocks_ref",
    "scatter_blocks_triton",
    "store_kv",
    "store_kv_ref",
    "store_kv_triton",
    "use_triton",
    "warm_up",
]
