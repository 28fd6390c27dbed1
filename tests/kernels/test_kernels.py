"""Kernels: each Triton kernel against its torch reference, and the attention reference
against dense causal attention.

By default (see conftest) the Triton kernels run under ``TRITON_INTERPRET=1`` on CPU
tensors. With ``EXPEDITOR_GPU_TESTS=1`` on a CUDA machine the same tests also run on the
GPU (the ``cuda`` parameter, marked ``gpu``).
"""

from __future__ import annotations

import importlib
import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from support.attention_cases import (
    DEVICES,
    INTERPRET,
    TOL,
    AttnCase,
    AttnInputs,
    make_attn_inputs,
    need_dot_dtype,
    need_triton,
    paged_attention_ref,
)

from gpu_worker.kernels import (
    copy_blocks,
    copy_blocks_ref,
    copy_blocks_triton,
    gather_blocks,
    gather_blocks_ref,
    gather_blocks_triton,
    paged_attention_triton,
    scatter_blocks,
    scatter_blocks_ref,
    scatter_blocks_triton,
    store_kv_ref,
    store_kv_triton,
)

GPU_TESTS = os.environ.get("EXPEDITOR_GPU_TESTS") == "1"

if GPU_TESTS:
    DEVICES.append(
        pytest.param(
            "cuda",
            id="cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
            ],
        )
    )

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# The same modules by path (the package re-exports functions under the module names).
BLOCK_COPY_MOD = importlib.import_module("gpu_worker.kernels.block_copy")


# ---------------------------------------------------------------- attention fixtures


ATTN_CASES = {
    "decode_gqa_4_2": AttnCase(((1, 1), (9, 1), (16, 1), (17, 1), (40, 1)), 4, 2, 16, 8),
    "decode_mqa_4_1": AttnCase(((5, 1), (8, 1), (23, 1)), 4, 1, 32, 16),
    "chunk_13_cached_5_new": AttnCase(((18, 5),), 4, 2, 16, 8),
    "prefill_whole_prompt": AttnCase(((21, 21),), 4, 2, 16, 8),
    "long_prefill_multi_tile": AttnCase(((45, 40), (3, 1)), 4, 1, 16, 8),
    "block_boundaries": AttnCase(((16, 16), (16, 1), (17, 1), (8, 8), (24, 8)), 4, 2, 16, 8),
    "mixed_4_seqs": AttnCase(((18, 5), (33, 1), (7, 7), (24, 1)), 4, 1, 32, 8),
    "mixed_mha_bs16": AttnCase(((30, 12), (1, 1), (17, 1)), 2, 2, 32, 16),
    "wide_group_8_1": AttnCase(((12, 12), (20, 1), (9, 3)), 8, 1, 16, 8),
    "seq_without_new_tokens": AttnCase(((10, 0), (6, 2), (11, 1)), 4, 2, 16, 8),
    "block_size_1": AttnCase(((7, 3), (5, 1)), 4, 2, 16, 1),
    "block_size_32_hd64": AttnCase(((40, 6), (33, 1)), 4, 2, 64, 32),
    "head_dim_128": AttnCase(((9, 4), (12, 1)), 2, 1, 128, 8),
}


def dense_attention(inp: AttnInputs, case: AttnCase) -> torch.Tensor:
    """Naive causal attention per sequence from the unpaged K/V, via SDPA in float32."""
    group = case.num_heads // case.num_kv_heads
    out = torch.zeros(inp.query.shape, dtype=torch.float32, device=inp.query.device)
    starts = inp.query_start_loc.tolist()
    for s, (seq_len, q_len) in enumerate(case.seqs):
        if q_len == 0:
            continue
        q = inp.query[starts[s] : starts[s + 1]].float().transpose(0, 1)  # [heads, q, d]
        k = inp.dense_k[s].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = inp.dense_v[s].float().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inp.scale)
        out[starts[s] : starts[s + 1]] = o.transpose(0, 1)
    return out


# ---------------------------------------------------------------- paged attention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_paged_attention_ref_matches_dense(name: str, dtype: torch.dtype, device: str) -> None:
    case = ATTN_CASES[name]
    inp = make_attn_inputs(case, dtype, device)
    out = paged_attention_ref(*inp.args())
    assert out.dtype == dtype and out.shape == inp.query.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), dense_attention(inp, case), atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_paged_attention_ref_any_block_size(block_size: int) -> None:
    case = AttnCase(((18, 5), (11, 1), (6, 6)), 4, 2, 16, block_size)
    inp = make_attn_inputs(case, torch.float32, "cpu", seed=block_size)
    torch.testing.assert_close(
        paged_attention_ref(*inp.args()), dense_attention(inp, case), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_paged_attention_triton_matches_ref(name: str, dtype: torch.dtype, device: str) -> None:
    need_triton(device)
    need_dot_dtype(device, dtype)
    case = ATTN_CASES[name]
    inp = make_attn_inputs(case, dtype, device, seed=1)
    ref = paged_attention_ref(*inp.args())
    out = paged_attention_triton(*inp.args())
    assert out.dtype == dtype and out.shape == inp.query.shape
    assert not out.isnan().any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def random_case(seed: int) -> AttnCase:
    """A random mixed batch of decodes and prefill chunks (<= 64 query tokens)."""
    g = torch.Generator().manual_seed(seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    heads, kv_heads = pick([(4, 2), (4, 1), (2, 2), (8, 2)])
    seqs = []
    for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
        seq_len = int(torch.randint(1, 48, (1,), generator=g))
        q_len = 1 if bool(torch.rand(1, generator=g) < 0.5) else seq_len
        q_len = min(q_len, 16) if len(seqs) else q_len  # keep the batch small
        q_len = int(torch.randint(1, q_len + 1, (1,), generator=g)) if q_len > 1 else 1
        seqs.append((seq_len, q_len))
    return AttnCase(tuple(seqs), heads, kv_heads, pick([16, 32]), pick([8, 16, 32]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(8))
def test_paged_attention_random_batches(seed: int, device: str) -> None:
    case = random_case(seed)
    inp = make_attn_inputs(case, torch.float32, device, seed=seed)
    ref = paged_attention_ref(*inp.args())
    torch.testing.assert_close(ref, dense_attention(inp, case), atol=1e-5, rtol=1e-5)
    need_triton(device)
    out = paged_attention_triton(*inp.args())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_triton_strided_query(device: str) -> None:
    """query as a strided view (e.g. a slice of a fused qkv projection)."""
    need_triton(device)
    case = ATTN_CASES["mixed_4_seqs"]
    inp = make_attn_inputs(case, torch.float32, device, seed=2)
    qkv = torch.randn(inp.query.shape[0], case.num_heads + 2, case.head_dim, device=device)
    qkv[:, : case.num_heads] = inp.query
    inp.query = qkv[:, : case.num_heads]
    assert not inp.query.is_contiguous()
    torch.testing.assert_close(
        paged_attention_triton(*inp.args()), paged_attention_ref(*inp.args()), atol=1e-5, rtol=1e-5
    )


# ---------------------------------------------------------------- window and softcap

WINDOW_CASES = {
    # Decodes, a chunk after a cached prefix, a whole prompt; GQA; block size 8.
    "mixed_gqa_bs8": AttnCase(((1, 1), (9, 1), (40, 1), (45, 12), (21, 21), (30, 5)), 4, 2, 16, 8),
    # A 40-token chunk after 30 cached tokens over 3 query tiles (BLOCK_Q 16); block size 16.
    "long_chunk_mqa_bs16": AttnCase(((70, 40), (33, 1), (5, 1)), 4, 1, 32, 16),
    "block_size_3": AttnCase(((26, 7), (14, 1), (9, 9)), 4, 2, 16, 3),
}
# (window, softcap): window 1, smaller than a block, spanning blocks, beyond every context.
WINDOW_SOFTCAP = [(1, None), (5, None), (20, None), (1000, None), (None, 1.5), (5, 1.5), (20, 1.5)]


def dense_windowed(inp: AttnInputs, case: AttnCase, window: int | None, softcap: float | None):
    """Hand-written attention, one query row and head at a time, from the unpaged K/V:
    row at position p attends to the keys j <= p with j > p - window, capped scores."""
    group = case.num_heads // case.num_kv_heads
    out = torch.zeros(inp.query.shape, dtype=torch.float32)
    starts = inp.query_start_loc.tolist()
    for s, (seq_len, q_len) in enumerate(case.seqs):
        for i in range(q_len):
            p = seq_len - q_len + i
            seen = torch.tensor([j for j in range(p + 1) if not window or j > p - window])
            for h in range(case.num_heads):
                k = inp.dense_k[s][seen, h // group].float().cpu()
                v = inp.dense_v[s][seen, h // group].float().cpu()
                scores = k @ inp.query[starts[s] + i, h].float().cpu() * inp.scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                out[starts[s] + i, h] = torch.softmax(scores, dim=0) @ v
    return out


@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_windowed_ref_matches_dense(name: str, window: int | None, softcap: float | None) -> None:
    case = WINDOW_CASES[name]
    inp = make_attn_inputs(case, torch.float32, "cpu", seed=3)
    out = paged_attention_ref(*inp.args(), window=window, softcap=softcap)
    expected = dense_windowed(inp, case, window, softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_windowed_triton_matches_ref(
    name: str, window: int | None, softcap: float | None, device: str
) -> None:
    need_triton(device)
    inp = make_attn_inputs(WINDOW_CASES[name], torch.float32, device, seed=4)
    ref = paged_attention_ref(*inp.args(), window=window, softcap=softcap)
    out = paged_attention_triton(*inp.args(), window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_windowed_triton_half_precision(device: str) -> None:
    need_triton(device)
    inp = make_attn_inputs(WINDOW_CASES["mixed_gqa_bs8"], torch.float16, device, seed=5)
    ref = paged_attention_ref(*inp.args(), window=5, softcap=1.5)
    out = paged_attention_triton(*inp.args(), window=5, softcap=1.5)
    assert out.dtype == torch.float16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_window_and_softcap_change_the_result(device: str) -> None:
    """Rows at positions >= window lose keys (and change), the others are untouched; the
    softcap changes every row that sees more than one key."""
    case, window = WINDOW_CASES["mixed_gqa_bs8"], 5
    inp = make_attn_inputs(case, torch.float32, device, seed=6)
    pos = torch.cat([torch.arange(n - q, n) for n, q in case.seqs])
    cut = pos >= window
    funcs = [paged_attention_ref]
    funcs += [paged_attention_triton] if device != "cpu" or INTERPRET else []
    for fn in funcs:
        full = fn(*inp.args()).cpu()
        windowed = fn(*inp.args(), window=window).cpu()
        torch.testing.assert_close(windowed[~cut], full[~cut], atol=1e-5, rtol=1e-5)
        assert ((windowed[cut] - full[cut]).abs().amax(dim=(1, 2)) > 1e-2).all(), fn.__name__
        capped = fn(*inp.args(), softcap=1.5).cpu()
        several = pos > 0
        assert ((capped[several] - full[several]).abs().amax(dim=(1, 2)) > 1e-3).all()
        torch.testing.assert_close(capped[~several], full[~several], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_windowed_triton_reads_nothing_before_the_windows(device: str) -> None:
    """K/V before every window of a sequence are NaN and the block table entries of blocks
    wholly before them garbage: the kernel reads neither (its key loop starts at the
    window), and the results are the reference's on the intact cache."""
    need_triton(device)
    case, window = AttnCase(((70, 40), (100, 1), (5, 1)), 4, 1, 32, 16), 8
    inp = make_attn_inputs(case, torch.float32, device, seed=7)
    ref = paged_attention_ref(*inp.args(), window=window)
    bs, cut_blocks = case.block_size, []
    for s, (seq_len, q_len) in enumerate(case.seqs):
        first_seen = max(seq_len - q_len - window + 1, 0)
        for j in range(first_seen):
            block = int(inp.block_tables[s, j // bs])
            inp.key_cache[block, j % bs] = float("nan")
            inp.value_cache[block, j % bs] = float("nan")
        inp.block_tables[s, : first_seen // bs] = 10**6
        cut_blocks.append(first_seen // bs)
    assert cut_blocks == [1, 5, 0]
    out = paged_attention_triton(*inp.args(), window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_window_zero_is_none_and_bad_values_raise() -> None:
    inp = make_attn_inputs(WINDOW_CASES["block_size_3"], torch.float32, "cpu", seed=8)
    funcs = [paged_attention_ref]
    funcs += [paged_attention_triton] if INTERPRET else []
    for fn in funcs:
        assert torch.equal(fn(*inp.args(), window=0), fn(*inp.args()))
        for window in (-1, 2.5, True, "8"):
            with pytest.raises(ValueError, match="window"):
                fn(*inp.args(), window=window)
        for softcap in (0.0, -1.0, math.nan, math.inf, "x"):
            with pytest.raises(ValueError, match="softcap"):
                fn(*inp.args(), softcap=softcap)


# ---------------------------------------------------------------- store_kv


def make_store_inputs(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    num_blocks, num_layers, bs, hkv, d = 6, 2, 8, 2, 16
    kv_cache = torch.randn(num_blocks, num_layers, 2, bs, hkv, d, generator=g).to(dtype)
    # Strided key/value: slices of a fused [tokens, q+k+v heads, d] projection.
    num_tokens = 12
    qkv = torch.randn(num_tokens, 4 + 2 * hkv, d, generator=g).to(dtype)
    key, value = qkv[:, 4 : 4 + hkv], qkv[:, 4 + hkv :]
    # Distinct slots in non-contiguous blocks, across block boundaries, one -1 (skipped).
    slots = torch.tensor([37, 38, 39, 40, 8, -1, 15, 16, 0, 47, 22, 23], dtype=torch.int64)
    return kv_cache.to(device), key.to(device), value.to(device), slots.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_ref_writes_slots(dtype: torch.dtype, device: str) -> None:
    kv_cache, key, value, slots = make_store_inputs(dtype, device)
    expected = kv_cache.clone()
    layer, bs = 1, kv_cache.shape[3]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // bs, layer, 0, slot % bs] = key[t]
            expected[slot // bs, layer, 1, slot % bs] = value[t]
    store_kv_ref(key, value, kv_cache[:, layer, 0], kv_cache[:, layer, 1], slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_triton_matches_ref(dtype: torch.dtype, device: str) -> None:
    need_triton(device)
    kv_cache, key, value, slots = make_store_inputs(dtype, device)
    expected = kv_cache.clone()
    store_kv_ref(key, value, expected[:, 0, 0], expected[:, 0, 1], slots)
    store_kv_triton(key, value, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots)
    assert torch.equal(kv_cache, expected)  # exact: a copy, and other layers untouched


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_triton_all_skipped_and_empty(device: str) -> None:
    need_triton(device)
    kv_cache, key, value, _ = make_store_inputs(torch.float32, device)
    before = kv_cache.clone()
    skip = torch.full((key.shape[0],), -1, dtype=torch.int64, device=device)
    store_kv_triton(key, value, kv_cache[:, 1, 0], kv_cache[:, 1, 1], skip)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    store_kv_triton(key[:0], value[:0], kv_cache[:, 1, 0], kv_cache[:, 1, 1], empty)
    assert torch.equal(kv_cache, before)


# ---------------------------------------------------------------- block copies


def make_cache(dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    return torch.randn(10, 2, 2, 4, 2, 16, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype: torch.dtype, device: str) -> None:
    kv_cache = make_cache(dtype, device)
    pairs = torch.tensor([[1, 5], [7, 2], [3, 9]], dtype=torch.int64, device=device)
    expected = kv_cache.clone()
    for src, dst in pairs.tolist():
        expected[dst] = expected[src]
    ref = kv_cache.clone()
    copy_blocks_ref(ref, pairs)
    assert torch.equal(ref, expected)
    need_triton(device)
    copy_blocks_triton(kv_cache, pairs)
    assert torch.equal(kv_cache, expected)
    copy_blocks_triton(kv_cache, pairs[:0])
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_blocks(dtype: torch.dtype, device: str) -> None:
    kv_cache = make_cache(dtype, device)
    ids = torch.tensor([4, 0, 7], dtype=torch.int64, device=device)
    expected = kv_cache[ids]
    ref = gather_blocks_ref(kv_cache, ids)
    assert ref.is_contiguous() and torch.equal(ref, expected)
    dst_ids = torch.tensor([9, 2, 5], dtype=torch.int32, device=device)  # int32 ids accepted
    ref_cache = kv_cache.clone()
    scatter_blocks_ref(ref, ref_cache, dst_ids)
    assert torch.equal(ref_cache[dst_ids.long()], expected)

    need_triton(device)
    out = gather_blocks_triton(kv_cache, ids)
    assert out.shape == (3, *kv_cache.shape[1:]) and out.is_contiguous()
    assert torch.equal(out, expected)
    tri_cache = kv_cache.clone()
    scatter_blocks_triton(out, tri_cache, dst_ids)
    assert torch.equal(tri_cache, ref_cache)
    assert gather_blocks_triton(kv_cache, ids[:0]).shape == (0, *kv_cache.shape[1:])


def test_swap_round_trip_across_devices_reference() -> None:
    """Swap out to a host pool and back in, via the dispatchers (reference path on CPU)."""
    gpu_side = make_cache(torch.float16, "cpu")
    host_pool = torch.zeros_like(gpu_side)
    staged = gather_blocks(gpu_side, torch.tensor([3, 8]))
    scatter_blocks(staged, host_pool, torch.tensor([0, 1]))
    assert torch.equal(host_pool[:2], gpu_side[torch.tensor([3, 8])])


# ---------------------------------------------------------------- dispatch


def test_block_copies_dispatch_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the references (whatever the environment), CUDA ones Triton."""
    monkeypatch.setenv("EXPEDITOR_FORCE_TRITON", "1")
    called: list[str] = []
    for name in ("copy_blocks_triton", "gather_blocks_triton", "scatter_blocks_triton"):
        monkeypatch.setattr(BLOCK_COPY_MOD, name, lambda *a, _n=name: called.append(_n))
    kv_cache = make_store_inputs(torch.float32, "cpu")[0]
    expected = kv_cache.clone()
    copy_blocks(kv_cache, torch.tensor([[0, 1]]))
    copy_blocks_ref(expected, torch.tensor([[0, 1]]))
    assert torch.equal(kv_cache, expected)
    assert torch.equal(gather_blocks(kv_cache, torch.tensor([2])), kv_cache[2:3])
    scatter_blocks(kv_cache[:1].clone(), kv_cache, torch.tensor([3]))
    assert called == [] and torch.equal(kv_cache[3], kv_cache[0])
    fake = SimpleNamespace(is_cuda=True)
    copy_blocks(fake, None)  # type: ignore[arg-type]
    gather_blocks(fake, None)  # type: ignore[arg-type]
    scatter_blocks(None, fake, None)  # type: ignore[arg-type]
    assert called == ["copy_blocks_triton", "gather_blocks_triton", "scatter_blocks_triton"]
