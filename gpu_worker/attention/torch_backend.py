"""The torch backend: paged attention in plain torch, simple and exact; the fallback, and
the reference of the other backends (docs/architecture.md, "Attention", has its design;
:mod:`gpu_worker.attention` the contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.attention import AttentionBackend, StepArrays, StepMetadata
from gpu_worker.kernels.attention_args import AttentionParams
from gpu_worker.kv_quant import dequantize, quantize

GROUP_ELEMENTS = 1 << 23
"""Bound on a decode group's gathered K elements (unless one sequence alone is more)."""
SCORE_ELEMENTS = 1 << 24
"""Bound on the float32 scores the soft-capped attention holds at once."""
Caches = tuple[Tensor, Tensor]
"""A layer's (key cache, value cache)."""


@dataclass(slots=True)
class Group:
    """``n`` sequences of ``m`` query rows each, attended by one call."""

    rows: torch.Tensor
    """[n, m] int64: the query (and output) rows."""
    q_pos: torch.Tensor
    """[n, m, 1] int64: their positions (``lens`` [n, 1, 1]: the sequences' keys)."""
    lens: torch.Tensor
    keys: int
    """Keys attended per sequence (whole blocks when gathered)."""
    blocks: torch.Tensor | None
    """[n, blocks] int64 to gather (block 0 past a sequence's own); None: a whole prompt
    reading the step's own K/V rows."""
    stale: torch.Tensor | None
    """[n, keys, 1, 1] bool: gathered slots past a context (zeroed), None when none."""
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int) -> torch.Tensor:
        """[n, m, keys] bool: the keys each row sees (``window`` 0: none)."""
        if window not in self.masks:
            key = torch.arange(self.keys, device=self.rows.device)
            seen = (key <= self.q_pos) & (key < self.lens)
            self.masks[window] = seen & (key > self.q_pos - window) if window else seen
        return self.masks[window]


def plan_groups(
    arrays: StepArrays,
    block_size: int,
    kv_row: int,
    device: torch.device,
    seqs: np.ndarray | None = None,
    own: bool = True,
) -> list[Group]:
    """The groups of sequences ``seqs`` (indices, None: all; those without rows or keys
    left out) of a step's host arrays; ``own``: whole prompts read the step's K/V rows."""
    starts, lens, tables = (
        np.asarray(arrays[n], dtype=np.int64)
        for n in ("query_start_loc", "seq_lens", "block_tables")
    )
    q_lens = np.diff(starts)
    seqs = np.arange(len(lens)) if seqs is None else seqs
    seqs = seqs[(q_lens[seqs] > 0) & (lens[seqs] > 0)]
    decodes = seqs[q_lens[seqs] == 1]
    decodes = decodes[np.argsort(-lens[decodes], kind="stable")]
    members = list(seqs[q_lens[seqs] > 1, None])
    while decodes.size:  # the longest first: as many as fit GROUP_ELEMENTS
        n = max(1, GROUP_ELEMENTS // (int(lens[decodes[0]]) * kv_row))
        members.append(decodes[:n])
        decodes = decodes[n:]
    groups = []
    for group in members:
        glens, m = lens[group], int(q_lens[group[0]])
        rows, q_pos = starts[group, None] + np.arange(m), (glens - m)[:, None] + np.arange(m)
        keys, blocks, stale = int(glens[0]), None, None
        if m != keys or not own:  # gather whole blocks (past its own: block 0)
            width = -(-int(glens.max()) // block_size)
            keys = width * block_size
            used = np.arange(width) < -(-glens[:, None] // block_size)
            blocks = _tensor(np.where(used, tables[group, :width], 0), device)
            past = np.arange(keys) >= glens[:, None]
            stale = _tensor(past[:, :, None, None], device) if past.any() else None
        rows_t, q_pos_t, lens_t = (_tensor(x, device) for x in (rows, q_pos[:, :, None], glens))
        groups.append(Group(rows_t, q_pos_t, lens_t[:, None, None], keys, blocks, stale))
    return groups


def store_index(
    arrays: StepArrays, block_size: int, device: torch.device
) -> tuple[tuple[Tensor, Tensor], Tensor | None]:
    """Where a step's new rows go: (block, offset) of each stored token, and which of the
    tokens those are (None: all)."""
    slots = np.asarray(arrays["slot_mapping"], dtype=np.int64)
    kept = np.flatnonzero(slots >= 0)
    store = (_tensor(slots[kept] // block_size, device), _tensor(slots[kept] % block_size, device))
    return store, None if kept.size == slots.size else _tensor(kept, device)


def store_layer(
    caches: Caches,
    scales: Caches | None,
    store: tuple[Tensor, Tensor],
    stored: Tensor | None,
    k: Tensor,
    v: Tensor,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Store a layer's new K/V rows (:func:`store_index`'s places); returns them as a
    cache read gives them back, in ``dtype``. With ``scales`` (a quantized cache, whose
    ``caches`` hold codes) the rows are stored as codes and scales, and come back
    dequantized."""
    stores = [(caches, (k, v))]
    if scales is not None:
        (k_codes, k_scale), (v_codes, v_scale) = (quantize(x, caches[0].dtype) for x in (k, v))
        stores = [(caches, (k_codes, v_codes)), (scales, (k_scale, v_scale))]
        k, v = dequantize(k_codes, k_scale, dtype), dequantize(v_codes, v_scale, dtype)
    for pair, rows in stores:
        for cache, new in zip(pair, rows, strict=True):
            cache.index_put_(store, (new if stored is None else new[stored]).to(cache.dtype))
    return k, v


def attend_group(
    g: Group,
    out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    caches: Caches,
    p: AttentionParams,
    scales: Caches | None = None,
) -> None:
    """One group's attention into its rows of ``out`` (the layer's new K/V stored;
    ``scales``: a quantized cache's, whose ``caches`` hold codes)."""
    (key_cache, value_cache), (n, m) = caches, g.rows.shape
    rows = g.rows.view(-1)
    if g.blocks is None:
        keys, values = k.index_select(0, rows)[None], v.index_select(0, rows)[None]
    else:
        shape = (n, g.keys, *key_cache.shape[2:])
        keys, values = key_cache[g.blocks].view(shape), value_cache[g.blocks].view(shape)
        if scales is not None:
            keys, values = (
                dequantize(codes, scale[g.blocks].view(shape[:-1]), q.dtype)
                for codes, scale in ((keys, scales[0]), (values, scales[1]))
            )
        if g.stale is not None:
            keys, values = keys.masked_fill_(g.stale, 0.0), values.masked_fill_(g.stale, 0.0)
    query = q.index_select(0, rows).view(n, m, *q.shape[1:])
    causal = g.blocks is None and not p.softcap and not 0 < p.window < g.keys
    attn = _attention(query, keys, values, None if causal else g.mask(p.window), p)
    out.index_copy_(0, rows, attn.reshape(n * m, *q.shape[1:]))


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: AttentionParams) -> Tensor:
    """q [n, m, heads, d], k/v [n, keys, kv_heads, d], mask [n, m, keys] (None: causal)
    -> [n, m, heads, d] in q's dtype."""
    scale, softcap = p.scale, p.softcap
    if mask is None or not softcap:
        qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        attn_mask = None if mask is None else mask[:, None]
        return F.scaled_dot_product_attention(
            *qkv, attn_mask=attn_mask, is_causal=mask is None, scale=scale, enable_gqa=True
        ).transpose(1, 2)
    n, m, heads, d = q.shape
    kv_heads, k, v = k.shape[2], k.float(), v.float()
    out = torch.empty_like(q)
    step = max(1, SCORE_ELEMENTS // (n * heads * k.shape[1]))
    for lo in range(0, m, step):  # scores [n, kv_heads, heads per KV head, rows, keys]
        qc = q[:, lo : lo + step].float().view(n, -1, kv_heads, heads // kv_heads, d)
        scores = torch.einsum("nmkgd,nlkd->nkgml", qc, k).mul_(scale / softcap).tanh_()
        hidden = ~mask[:, None, None, lo : lo + step]
        probs = scores.mul_(softcap).masked_fill_(hidden, -torch.inf).softmax(-1)
        out[:, lo : lo + step] = torch.einsum("nkgml,nlkd->nmkgd", probs, v).flatten(2, 3)
    return out


@dataclass(slots=True)
class TorchStep:
    store: tuple[torch.Tensor, torch.Tensor]
    """(block, offset) of each token with a slot."""
    stored: torch.Tensor | None
    """Those tokens, None when every token has a slot."""
    groups: list[Group]


class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, arrays: StepArrays, num_blocks: int, *, capture: bool = False) -> TorchStep:
        bs, device = self.layout.block_size, self.device
        store, stored = store_index(arrays, bs, device)
        kv_row = self.layout.num_kv_heads * self.layout.head_dim
        return TorchStep(store, stored, plan_groups(arrays, bs, kv_row, device))

    def forward(
        self, meta: StepMetadata, layer: int, q: Tensor, k: Tensor, v: Tensor, p: AttentionParams
    ) -> Tensor:
        step: TorchStep = meta.plan
        caches = meta.layer_caches[layer]
        scales = None if meta.layer_scales is None else meta.layer_scales[layer]
        k, v = store_layer(caches, scales, step.store, step.stored, k, v, q.dtype)
        out = torch.zeros_like(q)
        for g in step.groups:
            attend_group(g, out, q, k, v, caches, p, scales)
        return out


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` (shared memory on the host)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device)
