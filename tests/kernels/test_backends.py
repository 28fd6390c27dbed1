"""Every attention backend against the reference: per layer ``store_kv_ref`` +
``paged_attention_ref`` (the torch backend's attention over the stored cache) on a copy of
the cache.

Caches full of NaN wherever no token was stored, shuffled block ids, garbage past each
block table's own entries, tokens without a slot, rows outside every sequence, and mixed
batches of decodes, chunks after cached prefixes, whole prompts and idle sequences, with
GQA, sliding windows and soft-capping. The Triton backend runs under the interpreter
(small batches: it is slow there).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from support.attention_cases import (
    NUM_LAYERS,
    backend_for,
    make_step,
    mixed_seqs,
    paged_attention_ref,
    planned,
)

from gpu_worker import attention
from gpu_worker.decoder import expeditor_attention
from gpu_worker.kernels import store_kv_ref

BACKENDS = ["torch", "native", "triton"]


def run_both(
    backend: str,
    kv: torch.Tensor,
    meta: attention.StepMetadata,
    layers: list[torch.Tensor],
    group: int,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every layer through the backend (transformers' interface) and through the
    reference on a copy of the cache: (outputs, reference outputs, the reference cache)."""
    num_kv_heads = kv.shape[4]
    heads = num_kv_heads * group
    meta = planned(meta, backend_for(backend, kv, heads))
    expected_kv = kv.clone()
    outs, expected = [], []
    for layer, qkv in enumerate(layers):
        query, key, value = (
            qkv[None, 0, :heads],
            qkv[None, 1, :num_kv_heads],
            qkv[None, 2, :num_kv_heads],
        )
        scale = query.shape[-1] ** -0.5
        with torch.inference_mode():
            out, _ = expeditor_attention(
                SimpleNamespace(layer_idx=layer),  # type: ignore[arg-type]
                query, key, value, None, scaling=scale, expeditor_meta=meta,
                sliding_window=window, softcap=softcap,
            )  # fmt: skip
        outs.append(out[0])
        key_cache, value_cache = expected_kv[:, layer, 0], expected_kv[:, layer, 1]
        store_kv_ref(
            key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache,
            meta.slot_mapping,
        )  # fmt: skip
        expected.append(
            paged_attention_ref(
                query[0].transpose(0, 1),
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                scale,
                window=window,
                softcap=softcap,
            )
        )
    return outs, expected, expected_kv


def assert_same(
    kv: torch.Tensor,
    outs: list[torch.Tensor],
    expected: list[torch.Tensor],
    expected_kv: torch.Tensor,
    tol: float = 2e-5,
) -> None:
    assert torch.equal(kv.nan_to_num(7.0), expected_kv.nan_to_num(7.0))  # the same stores
    for out, ref in zip(outs, expected, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=tol, rtol=5 * tol)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(4, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_steps_match_the_reference(
    backend: str, num_kv_heads: int, group: int, block_size: int, seed: int
) -> None:
    kv, meta, layers = make_step(
        mixed_seqs(seed * 97 + block_size), num_kv_heads, group, 32, block_size, seed
    )
    assert_same(kv, *run_both(backend, kv, meta, layers, group))


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(2, 4, 32, 4), (3, 3, 64, 4), (2, 2, 20, 4), (3, 3, 64, 16), (9, 1, 128, 32)],
)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (5, 2.0)])
def test_bfloat16_steps_match_the_reference(
    backend: str, num_kv_heads: int, group: int, head_dim: int, block_size: int,
    window: int | None, softcap: float | None,
) -> None:  # fmt: skip
    """bfloat16 caches, queries and outputs (a bf16 CPU worker's): the stores are the
    same bits, the outputs within bf16's rounding of the reference run in bf16 (float32
    sums on both sides; each rounds its output once). head_dim 20 has a partial vector,
    64 and 128 take the bf16 dot products where the build has AVX-512 BF16, and 9 KV heads
    are more than the kernel's 8 at a time."""
    seqs = [(1, 1), (9, 9), (30, 30), (40, 5), (70, 20), (12, 0), (33, 1), (140, 1)]
    kv, meta, layers = make_step(
        seqs, num_kv_heads, group, head_dim, block_size, 5, 2, torch.bfloat16
    )
    outs, expected, expected_kv = run_both(backend, kv, meta, layers, group, window, softcap)
    assert kv.dtype == torch.bfloat16 and outs[0].dtype == torch.bfloat16
    assert_same(kv, outs, expected, expected_kv, tol=1.6e-2)


@pytest.mark.parametrize(
    ("backend", "head_dim", "block_size"),
    [(b, 16, 4) for b in BACKENDS] + [("native", 32, 16)],
)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 2.0), (20, 2.0)])
def test_windows_softcap_gqa_and_rows_outside(
    backend: str, head_dim: int, block_size: int, window: int | None, softcap: float | None
) -> None:
    """A decode, a short and a long prompt, a short and a long chunk, an idle sequence;
    tokens without slots before them: windows under a block and across blocks (and at
    block size 16 the native kernel's tiles within one block, at 4 across blocks)."""
    seqs = [(1, 1), (9, 9), (30, 30), (40, 5), (70, 20), (12, 0), (33, 1)]
    kv, meta, layers = make_step(seqs, 2, 4, head_dim, block_size, seed=31, lead_rows=2)
    outs, expected, expected_kv = run_both(backend, kv, meta, layers, 4, window, softcap)
    if backend == "triton":  # rows outside every sequence: left as they are
        outs, expected = [o[2:] for o in outs], [e[2:] for e in expected]
    assert_same(kv, outs, expected, expected_kv)
    for out in outs if backend != "triton" else []:
        assert torch.equal(out[:2], torch.zeros_like(out[:2]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decodes_of_several_blocks(backend: str) -> None:
    g = torch.Generator().manual_seed(3)
    seqs = [(int(n), 1) for n in torch.randint(1, 120, (12,), generator=g)]
    kv, meta, layers = make_step(seqs, 2, 4, 32, 16, 3)
    assert_same(kv, *run_both(backend, kv, meta, layers, 4, window=40))


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("lens", [[512, 512], [37, 100, 5], [1], [16, 17]])
def test_whole_prompts(backend: str, lens: list[int]) -> None:
    kv, meta, layers = make_step([(n, n) for n in lens], 2, 2, 16, 16, seed=len(lens))
    assert_same(kv, *run_both(backend, kv, meta, layers, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_backend_in_half_precision(dtype: torch.dtype) -> None:
    kv, meta, layers = make_step(mixed_seqs(21), 2, 4, 32, 16, seed=21)
    kv = kv.to(dtype)
    meta.layer_caches = [(kv[:, i, 0], kv[:, i, 1]) for i in range(NUM_LAYERS)]
    layers = [qkv.to(dtype) for qkv in layers]
    outs, expected, expected_kv = run_both("torch", kv, meta, layers, 4, 7, 3.0)
    assert torch.equal(kv.float().nan_to_num(7.0), expected_kv.float().nan_to_num(7.0))
    float_outs, _, _ = run_both(
        "torch", kv.float(), meta_float(meta, kv.float()), [x.float() for x in layers], 4, 7, 3.0
    )
    for out, ref, exact in zip(outs, expected, float_outs, strict=True):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)


def meta_float(meta: attention.StepMetadata, kv: torch.Tensor) -> attention.StepMetadata:
    meta.layer_caches = [(kv[:, i, 0], kv[:, i, 1]) for i in range(NUM_LAYERS)]
    return meta


def test_scale_defaults_to_head_dim() -> None:
    kv, meta, layers = make_step([(20, 1), (8, 8)], 1, 2, 16, 4, seed=9)
    meta = planned(meta, backend_for("native", kv, 2))
    qkv = layers[0]
    with torch.inference_mode():
        out, _ = expeditor_attention(
            SimpleNamespace(layer_idx=0),  # type: ignore[arg-type]
            qkv[None, 0, :2], qkv[None, 1, :1], qkv[None, 2, :1], None, expeditor_meta=meta,
        )  # fmt: skip
    ref = paged_attention_ref(
        qkv[0, :2].transpose(0, 1), kv[:, 0, 0], kv[:, 0, 1], meta.block_tables,
        meta.seq_lens, meta.query_start_loc, 1 / math.sqrt(16),
    )  # fmt: skip
    torch.testing.assert_close(out[0], ref, atol=1e-6, rtol=1e-6)


def test_the_chooser_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = torch.zeros(3, 2, 2, 4, 2, 16)
    layout = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=None)
    cpu = torch.device("cpu")
    for dtype, env, name, why in [
        (torch.float32, {"EXPEDITOR_NATIVE_CPU": "0"}, "torch", "EXPEDITOR_NATIVE_CPU=0"),
        (torch.bfloat16, {}, "native", "expeditor_cpu-"),
        (torch.float16, {}, "torch", "float32, bfloat16 on a CPU"),
        (torch.float32, {"EXPEDITOR_FORCE_TRITON": "1"}, "triton", "EXPEDITOR_FORCE_TRITON=1"),
    ]:
        backend, reason = attention.choose_backend(
            cpu, SimpleNamespace(**vars(layout), dtype=dtype), 4, env
        )
        assert backend.name == name and why in reason
    wide = SimpleNamespace(**{**vars(layout), "head_dim": 264}, dtype=torch.float32)
    backend, reason = attention.choose_backend(cpu, wide, 4, {})
    assert backend.name == "torch" and "beyond" in reason
    int8 = SimpleNamespace(**{**vars(layout), "kv_dtype": torch.int8}, dtype=torch.float32)
    backend, reason = attention.choose_backend(cpu, int8, 4, {})  # the C kernel reads int8
    assert backend.name == "native"
    fp8 = SimpleNamespace(**{**vars(layout), "kv_dtype": torch.float8_e5m2}, dtype=torch.float32)
    backend, reason = attention.choose_backend(cpu, fp8, 4, {})  # but no fp8 codes
    assert backend.name == "torch" and "torch.float8_e5m2 KV cache" in reason
    backend, reason = attention.choose_backend(cpu, int8, 4, {"EXPEDITOR_FORCE_TRITON": "1"})
    assert backend.name == "triton"
    assert backend_for("native", kv, 4).name == "native"


def test_expeditor_attention_needs_the_metadata() -> None:
    q = torch.zeros(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match="expeditor_meta"):
        expeditor_attention(SimpleNamespace(layer_idx=0), q, q, q, None)  # type: ignore[arg-type]
