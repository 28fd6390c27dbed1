"""Attention test cases shared by the kernel and backend tests, and their oracle:
:func:`paged_attention_ref`, the torch backend over a cache that holds every key."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from gpu_worker import attention
from gpu_worker.attention.torch_backend import attend_group, plan_groups
from gpu_worker.kernels import (
    store_kv_ref,
)
from gpu_worker.kernels.attention_args import check_args, layer_params

DEVICES = [pytest.param("cpu", id="cpu")]


# (atol, rtol) for Triton vs reference, and reference vs dense attention.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The torch backend's attention over a cache that holds every key already (the
    tests' oracle): ``query`` [tokens, heads, head_dim] -> the same shape."""
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    check_args(*args)
    params = layer_params(scale, window, softcap)
    host = {"query_start_loc": query_start_loc, "seq_lens": seq_lens, "block_tables": block_tables}
    arrays = {name: t.cpu().numpy() for name, t in host.items()}
    kv_row = key_cache.shape[2] * key_cache.shape[3]
    out = torch.zeros_like(query)
    for g in plan_groups(arrays, key_cache.shape[1], kv_row, query.device, own=False):
        attend_group(g, out, query, query, query, (key_cache, value_cache), params)
    return out


def need_triton(device: str) -> None:
    if device == "cpu" and not INTERPRET:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")


def need_dot_dtype(device: str, dtype: torch.dtype) -> None:
    if device == "cpu" and INTERPRET and dtype == torch.bfloat16:
        pytest.skip(
            "the Triton interpreter does not support tl.dot on bfloat16 operands (it "
            "multiplies the raw uint16 bit patterns; triton-lang/triton#11584)"
        )


@dataclass(frozen=True)
class AttnCase:
    seqs: tuple[tuple[int, int], ...]  # (seq_len incl. new tokens, q_len) per sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass
class AttnInputs:
    query: torch.Tensor
    kv_cache: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    dense_k: list[torch.Tensor]  # per sequence [seq_len, kv_heads, head_dim]
    dense_v: list[torch.Tensor]

    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )


def make_attn_inputs(case: AttnCase, dtype: torch.dtype, device: str, seed: int = 0) -> AttnInputs:
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [cdiv(seq_len, bs) for seq_len, _ in case.seqs]
    num_blocks = sum(needed) + 5
    num_layers, layer = 2, 1
    # NaN everywhere no token was stored: reading an unused slot poisons the output.
    kv_cache = torch.full((num_blocks, num_layers, 2, bs, hkv, d), float("nan"), dtype=dtype)
    key_cache, value_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    # Non-contiguous random block ids; padding entries hold garbage that must never be read.
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(case.seqs), max(needed) + 2), 10**6, dtype=torch.int32)
    dense_k, dense_v, queries = [], [], []
    used = 0
    for s, (seq_len, q_len) in enumerate(case.seqs):
        ids = perm[used : used + needed[s]]
        used += needed[s]
        block_tables[s, : needed[s]] = ids.to(torch.int32)
        k = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
        v = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
        pos = torch.arange(seq_len)
        slots = ids[pos // bs] * bs + pos % bs
        store_kv_ref(k, v, key_cache, value_cache, slots)
        dense_k.append(k)
        dense_v.append(v)
        queries.append(torch.randn(q_len, case.num_heads, d, generator=g).to(dtype))
    q_lens = torch.tensor([q for _, q in case.seqs])
    query_start_loc = torch.zeros(len(case.seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    kv_cache = kv_cache.to(device)
    return AttnInputs(
        query=torch.cat(queries).to(device),
        kv_cache=kv_cache,
        key_cache=kv_cache[:, layer, 0],
        value_cache=kv_cache[:, layer, 1],
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([s for s, _ in case.seqs], dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        scale=1.0 / math.sqrt(d),
        dense_k=[k.to(device) for k in dense_k],
        dense_v=[v.to(device) for v in dense_v],
    )


def mixed_seqs(seed: int, max_context: int = 300) -> list[tuple[int, int]]:
    """Decodes, chunks after cached prefixes, whole prompts and an idle sequence."""
    g = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    decodes = [(rand(1, max_context), 1) for _ in range(rand(3, 12))]
    chunks = []
    for _ in range(rand(1, 3)):
        new = rand(2, 40)
        chunks.append((new + rand(1, max_context - new), new))
    prompts = [(n, n) for n in (rand(2, 60), rand(2, 60))]
    seqs = [*decodes, *chunks, *prompts, (rand(1, 50), 0)]
    order = torch.randperm(len(seqs), generator=g).tolist()
    return [seqs[i] for i in order]


NUM_LAYERS = 2


def make_step(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seed: int,
    lead_rows: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, attention.StepMetadata, list[torch.Tensor]]:
    """``seqs``: (context length incl. new tokens, new tokens). Returns the KV cache, the
    step's metadata and per layer (query, key, value) in the attention interface's
    shapes, all in ``dtype``; ``lead_rows`` tokens without a slot (-1) precede the
    sequences'. The metadata has no backend yet: :func:`planned` gives it one."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(needed) + 3
    kv = torch.full((num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim), float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seqs), max(needed, default=0) + 2), 10**6, dtype=torch.int32)
    slots = [-1] * lead_rows
    used = 0
    for s, (seq_len, q_len) in enumerate(seqs):
        ids = perm[used : used + needed[s]]
        used += needed[s]
        tables[s, : needed[s]] = ids.to(torch.int32)
        cached = torch.arange(seq_len - q_len)
        for layer in range(NUM_LAYERS):
            for side in range(2):
                kv[ids[cached // block_size], layer, side, cached % block_size] = torch.randn(
                    (len(cached), num_kv_heads, head_dim), generator=g
                )
        slots += [int(ids[p // block_size]) * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]  # fmt: skip
    kv = kv.to(dtype)
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    starts = torch.full((len(seqs) + 1,), lead_rows, dtype=torch.int32)
    starts[1:] += torch.cumsum(q_lens, 0, dtype=torch.int32)
    meta = attention.StepMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
        query_start_loc=starts,
        layer_caches=[(kv[:, layer, 0], kv[:, layer, 1]) for layer in range(NUM_LAYERS)],
        backend=None,  # type: ignore[arg-type]
        plan=None,
    )
    tokens = len(slots)
    layers = [
        torch.randn((3, num_kv_heads * (group + 2), tokens, head_dim), generator=g).to(dtype)
        for _ in range(NUM_LAYERS)
    ]
    return kv, meta, layers


def planned(
    meta: attention.StepMetadata, backend: attention.AttentionBackend
) -> attention.StepMetadata:
    """``meta`` with ``backend`` and its plan of the step (from the metadata's tensors)."""
    fields = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    arrays = {name: getattr(meta, name).cpu().numpy() for name in fields}
    num_blocks = meta.layer_caches[0][0].shape[0]
    return dataclasses.replace(meta, backend=backend, plan=backend.plan(arrays, num_blocks))


def backend_for(name: str, kv: torch.Tensor, num_heads: int) -> attention.AttentionBackend:
    """The named backend for caches like ``kv`` ([blocks, layers, 2, block_size, kv_heads,
    head_dim]) and ``num_heads`` query heads, as the chooser makes it."""
    layout = SimpleNamespace(
        num_layers=kv.shape[1], num_kv_heads=kv.shape[4], head_dim=kv.shape[5],
        block_size=kv.shape[3], dtype=kv.dtype, kv_dtype=None,
    )  # fmt: skip
    env = {"native": {}, "torch": {"EXPEDITOR_NATIVE_CPU": "0"}}
    backend, _ = attention.choose_backend(
        torch.device("cpu"), layout, num_heads, env.get(name, {"EXPEDITOR_FORCE_TRITON": "1"})
    )
    if backend.name != name:
        pytest.skip(f"no {name} backend here")
    return backend


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
