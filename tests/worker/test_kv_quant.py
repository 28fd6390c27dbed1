"""The quantized KV cache: codes and scales, the block as bytes, the torch backend's
attention over it against the reference over the dequantized cache, and the Triton
kernels (under the interpreter) and the native C kernel (int8) against the torch
backend."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from support.attention_cases import TOL, paged_attention_ref
from torch import Tensor

from gpu_worker.attention import AttentionBackend, StepMetadata, choose_backend
from gpu_worker.attention.torch_backend import TorchBackend
from gpu_worker.attention.triton_backend import TritonBackend
from gpu_worker.kernels.attention_args import layer_params
from gpu_worker.kernels.attention_schedule import (
    INTERPRET,
    PARTITION_MULTIPLE,
    SPLIT_MIN_PARTITIONS,
    plan_attention,
)
from gpu_worker.kernels.paged_attention import paged_attention_triton
from gpu_worker.kv_cache import KVCache, KVLayout
from gpu_worker.kv_quant import KV_CACHE_DTYPES, MIN_SCALE, dequantize, kv_storage_dtype, quantize

CODES = list(KV_CACHE_DTYPES.values())
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
SUBNORMAL_STEP = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}


@pytest.mark.parametrize("dtype", CODES, ids=str)
def test_each_row_decodes_within_its_codes_rounding(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn((50, 4, 64), generator=g) * torch.rand((50, 4, 1), generator=g) * 10
    x[3, 1] = 0.0  # an all-zero row
    x[7, 2, 5] = 1e4  # an outlier widens its own row's scale only
    codes, scale = quantize(x, dtype)
    assert codes.dtype == dtype and scale.dtype == torch.float16 and scale.shape == (50, 4)
    back = dequantize(codes, scale, torch.float32)
    err, step = (back - x).abs(), scale.float()[..., None]
    if dtype == torch.int8:
        assert (err <= step / 2 + 1e-6 * x.abs()).all()
    else:  # the nearest float8: relative rounding, subnormals in steps of the scale
        bound = x.abs() * 2.0 ** -(MANTISSA_BITS[dtype] + 1) + step * SUBNORMAL_STEP[dtype]
        assert (err <= bound * (1 + 1e-5)).all()
    assert torch.equal(back[3, 1], torch.zeros(64)) and scale[3, 1].item() == MIN_SCALE
    assert torch.equal(quantize(x[7, :1], dtype)[1], scale[7, :1])  # the row's own scale
    assert back[7, 2, 5] == pytest.approx(1e4, rel=2.0**-3)


def test_a_quantized_block_is_codes_then_scales_in_one_run() -> None:
    shape = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
    bf16 = KVLayout(**shape, dtype=torch.bfloat16)
    int8 = KVLayout(**shape, dtype=torch.bfloat16, kv_dtype=torch.int8)
    rows = 3 * 2 * 16 * 2
    assert bf16.bytes_per_block == rows * 128 and int8.bytes_per_block == rows * (64 + 2)
    assert bf16.bytes_per_block / int8.bytes_per_block == pytest.approx(1.94, abs=0.01)
    cache = KVCache(int8, 5, torch.device("cpu"))
    assert cache.kv.shape == (5, int8.bytes_per_block) and cache.kv.dtype == torch.uint8
    assert cache.layer_scales is not None
    key, value = cache.layer_caches[2]
    key_scale, _ = cache.layer_scales[2]
    assert key.shape == (5, 16, 2, 64) and key.dtype == torch.int8
    key[4, 3, 1, 7] = -5
    key_scale[4, 3, 1] = 0.5
    raw = cache.kv[4]  # both live in block 4's bytes, nowhere else
    codes = raw[: int8.code_bytes].view(torch.int8).view(int8.block_shape)
    scales = raw[int8.code_bytes :].view(torch.float16).view(int8.scale_shape)
    assert codes[2, 0, 3, 1, 7] == -5 and scales[2, 0, 3, 1] == 0.5
    assert int(cache.kv[:4].count_nonzero()) == 0
    assert value.data_ptr() == key.data_ptr() + 16 * 2 * 64


def test_the_setting_names_the_codes() -> None:
    assert kv_storage_dtype("auto") is None and kv_storage_dtype("int8") == torch.int8
    with pytest.raises(ValueError, match="'int4' is not one of auto, int8, fp8_e4m3"):
        kv_storage_dtype("int4")


SEQS = [(9, 1), (6, 6), (13, 3), (4, 1), (SPLIT_MIN_PARTITIONS * PARTITION_MULTIPLE + 3, 1)]
"""(keys after the step, new rows): decodes (one long enough to split), a whole prompt,
a chunk after a prefix."""
HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 4
KINDS = [(None, None), (5, None), (None, 20.0)]


def quantized_step(dtype: torch.dtype, seed: int = 1) -> tuple[KVCache, dict, list[Tensor]]:
    """A cache of random codes under :data:`SEQS`' block tables, the step's host arrays,
    and its q, k, v."""
    g = torch.Generator().manual_seed(seed)
    layout = KVLayout(
        num_layers=2, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BS,
        dtype=torch.float32, kv_dtype=dtype,
    )  # fmt: skip
    needed = [-(-n // BS) for n, _ in SEQS]
    cache = KVCache(layout, sum(needed) + 2, torch.device("cpu"))
    perm = torch.randperm(cache.num_blocks, generator=g)
    tables = np.zeros((len(SEQS), max(needed)), dtype=np.int32)
    slots: list[int] = []
    used = 0
    for s, (n, new) in enumerate(SEQS):
        tables[s, : needed[s]] = perm[used : used + needed[s]]
        used += needed[s]
        slots += [int(tables[s, p // BS]) * BS + p % BS for p in range(n - new, n)]
    values, scales = layout.views(cache.kv)
    assert scales is not None
    codes, scale = quantize(torch.randn(values.shape, generator=g), dtype)  # the cached keys
    values.copy_(codes)
    scales.copy_(scale)
    q_lens = [new for _, new in SEQS]
    arrays = {
        "slot_mapping": np.array(slots, dtype=np.int64),
        "block_tables": tables,
        "seq_lens": np.array([n for n, _ in SEQS], dtype=np.int32),
        "query_start_loc": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
    }
    tokens = len(slots)
    q = torch.randn((tokens, HEADS, DIM), generator=g)
    k, v = (torch.randn((tokens, KV_HEADS, DIM), generator=g) for _ in range(2))
    return cache, arrays, [q, k, v]


def forward(backend: AttentionBackend, cache: KVCache, arrays: dict, qkv: list, p) -> Tensor:
    meta = StepMetadata(
        **{name: torch.from_numpy(a) for name, a in arrays.items()},
        layer_caches=cache.layer_caches,
        backend=backend,
        plan=backend.plan(arrays, cache.num_blocks),
        layer_scales=cache.layer_scales,
    )
    return backend.forward(meta, 1, *qkv, p)


def decoded_reference(cache: KVCache, arrays: dict, q: Tensor, p) -> Tensor:
    """paged_attention_ref over layer 1 of the cache dequantized."""
    assert cache.layer_scales is not None
    (key, value), (key_scale, value_scale) = cache.layer_caches[1], cache.layer_scales[1]
    decoded = (
        dequantize(key, key_scale, torch.float32),
        dequantize(value, value_scale, torch.float32),
    )
    tables = (torch.from_numpy(arrays[n]) for n in ("block_tables", "seq_lens", "query_start_loc"))
    return paged_attention_ref(
        q, *decoded, *tables, p.scale, window=p.window or None, softcap=p.softcap or None
    )


@pytest.mark.parametrize("dtype", CODES, ids=str)
@pytest.mark.parametrize(("window", "softcap"), KINDS)
def test_the_torch_backend_attends_over_what_the_cache_decodes_to(
    dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    cache, arrays, (q, k, v) = quantized_step(dtype)
    before = dequantize(cache.layer_caches[0][0], cache.layer_scales[0][0], torch.float32)
    p = layer_params(DIM**-0.5, window, softcap)
    out = forward(
        TorchBackend(cache.layout, HEADS, torch.device("cpu")), cache, arrays, [q, k, v], p
    )
    (key, _), (key_scale, _) = cache.layer_caches[1], cache.layer_scales[1]
    slot = torch.from_numpy(arrays["slot_mapping"])
    stored = dequantize(key[slot // BS, slot % BS], key_scale[slot // BS, slot % BS], k.dtype)
    assert torch.equal(stored, dequantize(*quantize(k, dtype), torch.float32))
    torch.testing.assert_close(out, decoded_reference(cache, arrays, q, p), atol=2e-5, rtol=1e-5)
    after = dequantize(cache.layer_caches[0][0], cache.layer_scales[0][0], torch.float32)
    assert torch.equal(after, before)  # the other layer untouched


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize(("window", "softcap"), KINDS)
def test_the_triton_kernels_store_and_read_codes_as_the_torch_backend(
    window: int | None, softcap: float | None
) -> None:
    cpu = torch.device("cpu")
    ours, arrays, qkv = quantized_step(torch.int8)
    theirs, _, _ = quantized_step(torch.int8)
    p = layer_params(DIM**-0.5, window, softcap)
    out = forward(TritonBackend(ours.layout, HEADS, cpu), ours, arrays, qkv, p)
    want = forward(TorchBackend(theirs.layout, HEADS, cpu), theirs, arrays, qkv, p)
    assert torch.equal(ours.kv, theirs.kv)  # the same codes and scales stored
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    # The long decode split over partitions (a "GPU" too large for one program per head).
    starts, lens = arrays["query_start_loc"], arrays["seq_lens"]
    schedule = plan_attention(
        starts, lens, num_kv_heads=KV_HEADS, queries_per_kv=HEADS // KV_HEADS, head_dim=DIM,
        block_size=BS, num_sms=1 << 20, device=cpu, partition_size=PARTITION_MULTIPLE,
    )  # fmt: skip
    assert schedule.split is not None
    tables = (torch.from_numpy(arrays[n]) for n in ("block_tables", "seq_lens", "query_start_loc"))
    split = paged_attention_triton(
        qkv[0], *ours.layer_caches[1], *tables, p.scale, window=window, softcap=softcap,
        schedule=schedule, scales=ours.layer_scales[1],
    )  # fmt: skip
    torch.testing.assert_close(split, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), KINDS)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_native_kernel_reads_int8_codes_as_the_torch_backend(
    window: int | None, softcap: float | None, model_dtype: torch.dtype
) -> None:
    """The C kernel dequantizes each block tile it reads: the same bytes stored as the
    torch backend's, the same attention (decodes, a chunk after a prefix, a whole
    prompt through the prompt groups), in float32 and bfloat16 queries."""
    cpu = torch.device("cpu")
    ours, arrays, qkv = quantized_step(torch.int8)
    theirs, _, _ = quantized_step(torch.int8)
    for cache in (ours, theirs):
        cache.layout = dataclasses.replace(cache.layout, dtype=model_dtype)
    qkv = [x.to(model_dtype) for x in qkv]
    backend, reason = choose_backend(cpu, ours.layout, HEADS, {})
    if backend.name != "native":
        pytest.skip(f"no native kernel here: {reason}")
    p = layer_params(DIM**-0.5, window, softcap)
    out = forward(backend, ours, arrays, qkv, p)
    want = forward(TorchBackend(theirs.layout, HEADS, cpu), theirs, arrays, qkv, p)
    assert torch.equal(ours.kv, theirs.kv)  # the same codes and scales stored
    # bfloat16: torch rounds the decoded rows to bf16, the kernel keeps them in float32.
    atol, rtol = (2e-5, 1e-5) if model_dtype == torch.float32 else TOL[torch.bfloat16]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    assert out.abs().sum() > 0


def test_fp8_caches_stay_on_the_torch_backend_on_a_cpu() -> None:
    layout = KVLayout(
        num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BS,
        dtype=torch.float32, kv_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    backend, reason = choose_backend(torch.device("cpu"), layout, HEADS, {})
    assert backend.name == "torch" and "float8_e4m3fn" in reason
