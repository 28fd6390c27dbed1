"""The CPU attention path's per-step plan: what every layer of a step shares.

:func:`plan_cpu_step` turns a step's :class:`StepMetadata` into a :class:`CpuStepPlan`
with numpy: the cache indices of the new tokens, and per group of sequences
(:func:`~gpu_worker.kernels.cpu_attention.group_sequences`) the blocks to gather, the
stale rows to zero, the query rows, the attention mask and where each layer gathers.

Decode steps whose sequences are the last step's, each one token further (the steady
state of a batch), reuse the last plan when the metadata carries a
:class:`DecodeReuse`: each layer keeps its gathered K/V from the last step and only adds
the new tokens' rows, and the masks show one more key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.kernels.attention_schedule import AttentionSchedule
from gpu_worker.kernels.cpu_attention import SCRATCH, group_sequences
from gpu_worker.kernels.cpu_native import NativeStep

_FOLD_MAX_Q = 16
"""Groups with at most this many query rows per sequence fold their GQA heads."""

_GROUP_COST_ELEMENTS = 1 << 17
"""What one more group costs (its plan, and per layer its calls), in gathered and
attended elements: a group may pad this many over its real ones, divided by the
elements of a key row (its K and V, and the query heads' half of the attention)."""

_REUSE_MAX_ELEMENTS = 1 << 25
"""Gathered K/V elements of all layers together up to which a worker keeps them across
steps (each layer then has its own buffer; above, all share one)."""


@dataclass(slots=True)
class GroupBuffers:
    """Where a layer gathers a group's K/V, and the views of it that it uses."""

    k_out: torch.Tensor
    """[n * keys / block_size, block_size, kv_heads, head_dim]: the gathered keys
    (``v_out`` the values, right after them)."""
    v_out: torch.Tensor
    gathered: torch.Tensor
    """Both, as [2 * n * keys, kv_heads, head_dim] rows (``stale`` indexes them)."""
    k: torch.Tensor
    """The gathered keys as SDPA takes them: [n, kv_heads, keys, head_dim]."""
    v: torch.Tensor


@dataclass(slots=True)
class CpuGroup:
    """One padded SDPA call of a step: ``n`` sequences, ``keys`` gathered key slots and
    ``max_q`` query rows each."""

    members: np.ndarray
    """The group's sequences (indices into the step's), increasing."""
    n: int
    keys: int
    max_q: int
    blocks: torch.Tensor
    """[n * keys / block_size] int64: the cache blocks to gather; past a sequence's own
    blocks the first block of the group's longest sequence (masked: real, finite K/V)."""
    stale: torch.Tensor | None
    """Rows of the gathered ``[2 * n * keys]`` K then V read from slots past a context
    (they may hold anything, even NaN, which a mask would not hide: zeroed), or None."""
    rows: torch.Tensor | None
    """[n * max_q] int64: query row of each padded row (padding repeats the last); None
    when they are all the query's rows in order (the group is the whole step)."""
    mask: torch.Tensor | None
    """Additive (0 or -inf, the query's dtype) over the keys: [n, 1, max_q, keys], or
    [n, 1, max_q * heads per KV head, keys] when ``fold`` (1 row when max_q is 1);
    None when ``causal``."""
    causal: bool
    """Every sequence is a whole prompt from position 0: SDPA's own causal mask."""
    fold: bool
    """The query heads of each KV head attend as the rows of one head (few query rows:
    each K/V row is then read once for all of them, not once per query head)."""
    real: torch.Tensor | None
    """[n * max_q] bool: padded rows that are real ones, None when all are."""
    out_rows: torch.Tensor | None
    """Output row of each real padded row; None when ``rows`` is."""
    buffers: list[GroupBuffers] = field(default_factory=list)
    """Per layer (one shared by all, unless the gathered K/V are kept across steps)."""
    new_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """When the layers keep last step's gathered K/V: the rows of ``gathered`` where
    this step's new key and value of each sequence go (and nothing is gathered)."""


@dataclass(slots=True)
class CpuStepPlan:
    """Everything about a step's CPU attention that does not depend on the layer."""

    store_index: tuple[torch.Tensor, torch.Tensor] | None
    """(block, offset) of every new token with a slot, None when there are none."""
    store_tokens: torch.Tensor | None
    """The tokens with a slot (slot >= 0), None when every token has one."""
    groups: list[CpuGroup]
    covers_all: bool
    """The groups write every query row (the output needs no zero fill)."""


@dataclass(slots=True)
class DecodeReuse:
    """What a worker keeps between steps so that a decode step whose sequences are the
    last step's, each one token further, gathers nothing: each layer keeps its gathered
    K/V and adds the new tokens' rows. Valid while nothing else writes those sequences'
    blocks (the cache's contract: a block is written by its one owner, copy-on-write)."""

    plan: CpuStepPlan | None = None
    lens: np.ndarray | None = None
    tables: list[np.ndarray] = field(default_factory=list)
    """Per group, its sequences' block tables up to ``keys`` (compared where owned)."""
    cache: tuple[int, ...] = ()
    """The caches' identity (data pointers): another cache gathers again."""


@dataclass(slots=True)
class StepMetadata:
    """Per-step attention inputs, shared by every layer."""

    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block * block_size + offset) of each new token."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: context length after this step's tokens."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: where each sequence's tokens start in the packed batch."""
    layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer: (key cache, value cache) views of the device KV cache."""
    cpu_plan: CpuStepPlan | None = None
    """Built by the first layer of a step off the Triton path."""
    reuse: DecodeReuse | None = None
    """The worker's state across steps (None: every step gathers)."""
    native_step: NativeStep | None = None
    """The native CPU kernel's split of the step, made (and its indices checked) by the
    first layer."""
    attention_schedule: AttentionSchedule | None = None
    """The Triton path's launches, planned once per step on the host (None: each
    layer plans its own, reading the lengths back from the device)."""


def _host(tensor: torch.Tensor) -> np.ndarray:
    """An int64 numpy copy (or view) of a small index tensor."""
    return tensor.cpu().numpy().astype(np.int64, copy=False)


def plan_cpu_step(meta: StepMetadata, query: torch.Tensor, key_cache: torch.Tensor) -> CpuStepPlan:
    """The layer-independent part of ``store_kv_ref`` and ``paged_attention_cpu`` for a
    step whose query is ``query`` [tokens, heads, head_dim] and caches ``key_cache``'s
    shape (host tensors: the indices are built with numpy)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    device = key_cache.device
    slots = _host(meta.slot_mapping)
    store_tokens = None
    if slots.size and slots.min() < 0:
        kept = np.flatnonzero(slots >= 0)
        store_tokens, slots = _tensor(kept, device), slots[kept]
    store_index = None
    if slots.size:
        store_index = (
            _tensor(slots // block_size, device),
            _tensor(slots % block_size, device),
        )

    starts = _host(meta.query_start_loc)
    lens = _host(meta.seq_lens)
    q_lens = starts[1:] - starts[:-1]
    tables = meta.block_tables.cpu().numpy()
    total = query.shape[0]
    decode = total == len(lens) and int(starts[0]) == 0 and bool((q_lens == 1).all())
    reuse = meta.reuse
    if reuse is not None and decode:
        reused = _reuse(reuse, meta, lens, tables, block_size, device)
        if reused is not None:
            reused.store_index, reused.store_tokens = store_index, store_tokens
            return reused

    active = np.flatnonzero((q_lens > 0) & (lens > 0))
    kv_row = num_kv_heads * head_dim
    q_row = query.shape[1] * head_dim
    members = group_sequences(
        active.tolist(),
        q_lens.tolist(),
        lens.tolist(),
        kv_row,
        q_row,
        waste=_GROUP_COST_ELEMENTS / (kv_row + q_row / 2),
    )
    covers_all = int(q_lens[active].sum()) == total
    # One group taking every query row: its rows are the query's, in order.
    whole = len(members) == 1 and covers_all and int(starts[0]) == 0
    groups = [
        _plan_group(
            np.array(sorted(group)),
            tables,
            lens,
            starts,
            q_lens,
            block_size,
            query,
            num_kv_heads,
            whole=whole,
        )
        for group in members
    ]
    num_layers = len(meta.layer_caches)
    gathered = sum(2 * g.n * g.keys for g in groups) * kv_row * num_layers
    keep = reuse is not None and decode and covers_all and gathered <= _REUSE_MAX_ELEMENTS
    _place_groups(groups, key_cache, num_layers if keep else 1)
    plan = CpuStepPlan(store_index, store_tokens, groups, covers_all)
    if reuse is not None:
        reuse.plan = plan if keep else None
        if keep:
            reuse.lens = lens
            reuse.tables = [tables[g.members, : g.keys // block_size] for g in groups]
            reuse.cache = _cache_id(meta)
    return plan


def _cache_id(meta: StepMetadata) -> tuple[int, ...]:
    return tuple(cache.data_ptr() for pair in meta.layer_caches for cache in pair)


def _reuse(
    reuse: DecodeReuse,
    meta: StepMetadata,
    lens: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    device: torch.device,
) -> CpuStepPlan | None:
    """The last step's plan for this decode step, when its sequences are the last
    step's (the same blocks where they had any), each one token further: the layers
    then add each new token's K/V to what they gathered, and the masks show one more
    key. None (and nothing changed) otherwise."""
    plan = reuse.plan
    if plan is None or reuse.lens is None or lens.shape != reuse.lens.shape:
        return None
    if not np.array_equal(lens, reuse.lens + 1) or reuse.cache != _cache_id(meta):
        return None
    current = []
    for g, old in zip(plan.groups, reuse.tables, strict=True):
        seq_lens = lens[g.members]
        num_blocks = old.shape[1]
        if int(seq_lens.max()) > g.keys or tables.shape[1] < num_blocks:
            return None
        table = tables[g.members, :num_blocks]
        owned = np.arange(num_blocks)[None, :] < (-(-(seq_lens - 1) // block_size))[:, None]
        if not np.array_equal(table[owned], old[owned]):
            return None
        current.append(table)
    reuse.lens, reuse.tables = lens, current
    for g in plan.groups:
        at = np.arange(g.n)
        new_keys = at * g.keys + lens[g.members] - 1
        g.new_rows = (_tensor(new_keys, device), _tensor(new_keys + g.n * g.keys, device))
        if g.mask is not None:
            g.mask.view(g.n, g.keys).index_put_(
                (_tensor(at, device), _tensor(lens[g.members] - 1, device)),
                torch.zeros((), dtype=g.mask.dtype, device=device),
            )
    return plan


def _place_groups(groups: list[CpuGroup], key_cache: torch.Tensor, copies: int) -> None:
    """Give each group its own region of ``copies`` scratch buffers (one shared by all
    layers, or one per layer) and the views of it that a layer uses, made once."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    block = block_size * num_kv_heads * head_dim
    sizes = [2 * g.blocks.shape[0] * block for g in groups]
    for copy in range(copies):
        buffer = SCRATCH.take(2 + copy, key_cache, (sum(sizes),))
        offset = 0
        for g, size in zip(groups, sizes, strict=True):
            region = buffer[offset : offset + size]
            offset += size
            kv = region.view(2, g.blocks.shape[0], block_size, num_kv_heads, head_dim)
            g.buffers.append(
                GroupBuffers(
                    kv[0],
                    kv[1],
                    region.view(2 * g.n * g.keys, num_kv_heads, head_dim),
                    kv[0].view(g.n, g.keys, num_kv_heads, head_dim).transpose(1, 2),
                    kv[1].view(g.n, g.keys, num_kv_heads, head_dim).transpose(1, 2),
                )
            )


def _plan_group(
    group: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    starts: np.ndarray,
    q_lens: np.ndarray,
    block_size: int,
    query: torch.Tensor,
    num_kv_heads: int,
    *,
    whole: bool,
) -> CpuGroup:
    """``paged_attention_cpu``'s per-group indices and mask, computed once. ``group``
    in increasing order; ``whole``: it is the step's only group and its sequences' rows
    are all of the query's."""
    n = len(group)
    device = query.device
    seq_lens = lens[group]
    group_q = q_lens[group]
    num_blocks = -(-int(seq_lens.max()) // block_size)
    keys = num_blocks * block_size
    max_q = int(group_q.max())

    # Table entries past a sequence's own blocks may hold anything: read the first block
    # of the group's longest sequence there instead (full when there is padding: real,
    # finite K/V, which the mask hides).
    own = -(-seq_lens // block_size)
    blocks = tables[group, :num_blocks].astype(np.int64)
    if int(own.min()) < num_blocks:
        fill = blocks[int(np.argmax(own)), 0]
        blocks[np.arange(num_blocks)[None, :] >= own[:, None]] = fill
    stale = _stale_rows(seq_lens, own, keys, block_size)

    key_pos = np.arange(keys)
    row = np.arange(max_q)
    uniform = int(group_q.min()) == max_q
    rows = None
    if not (whole and uniform):
        rows = starts[group][:, None] + np.minimum(row[None, :], (group_q - 1)[:, None])
        rows = rows.reshape(-1)
    # Whole prompts (from position 0): query row i sees keys 0..i, SDPA's own causal
    # mask. A padded row sees stale keys too (zeroed, or copies of real ones), and is
    # dropped.
    causal = bool((group_q == seq_lens).all())
    per_kv_head = query.shape[1] // num_kv_heads
    fold = not causal and per_kv_head > 1 and max_q <= _FOLD_MAX_Q
    mask = None
    if not causal:
        if max_q == 1:
            visible = (key_pos[None, :] < seq_lens[:, None])[:, None]  # [n, 1, keys]
        else:
            q_pos = (seq_lens - group_q)[:, None] + row[None, :]  # [n, max_q]
            visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
                key_pos[None, None, :] < seq_lens[:, None, None]
            )
            if fold:
                visible = np.repeat(visible, per_kv_head, axis=1)
        additive = np.where(visible[:, None], np.float32(0.0), np.float32(-np.inf))
        mask = _tensor(additive, device).to(query.dtype)
    real = out_rows = None
    if rows is not None:
        if uniform:
            out_rows = _tensor(rows, device)
        else:
            real_np = (row[None, :] < group_q[:, None]).reshape(-1)
            real, out_rows = _tensor(real_np, device), _tensor(rows[real_np], device)
    return CpuGroup(
        group,
        n,
        keys,
        max_q,
        _tensor(blocks.reshape(-1), device),
        None if stale is None else _tensor(stale, device),
        None if rows is None else _tensor(rows, device),
        mask,
        causal,
        fold,
        real,
        out_rows,
    )


def _stale_rows(
    seq_lens: np.ndarray, own: np.ndarray, keys: int, block_size: int
) -> np.ndarray | None:
    """Rows of a group's gathered ``[2, n, keys]`` K/V copies read from slots past a
    context, the tail of each sequence's last block (they may hold anything, even NaN,
    which a mask would not hide), or None when there are none."""
    tail = seq_lens - (own - 1) * block_size  # rows of the last block in use: 1..bs
    cut = np.flatnonzero(tail < block_size)
    if not cut.size:
        return None
    offsets = np.arange(block_size)
    first = cut * keys + (own[cut] - 1) * block_size
    found = (first[:, None] + offsets)[offsets[None, :] >= tail[cut, None]]
    return np.concatenate([found, found + len(seq_lens) * keys])


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (shared memory on the host)."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)
