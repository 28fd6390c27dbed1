"""The worker's CPU attention path (a plan per step, reused by every layer) against
``store_kv_ref`` + ``paged_attention_cpu`` per layer, which it must reproduce.

Caches full of NaN wherever no token was stored, shuffled block ids, garbage past each
block table's own entries, tokens without a slot, and mixed batches of decodes, chunks
after cached prefixes, whole prompts and idle sequences.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from support.attention_cases import (
    NUM_LAYERS,
    make_step,
    mixed_seqs,  # the same batch shapes as the kernel's tests
)

from gpu_worker import attention
from gpu_worker.kernels import paged_attention_cpu, paged_attention_ref, store_kv_ref


@pytest.fixture(autouse=True)
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the torch path's plan: the native kernel stays out."""
    monkeypatch.setenv("EXPEDITOR_NATIVE_CPU", "0")


def run_both(
    kv: torch.Tensor, meta: attention.StepMetadata, layers: list[torch.Tensor], group: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every layer through the planned path and through the per-layer kernels, each on
    its own copy of the cache: (planned outputs, kernel outputs, the two caches)."""
    num_kv_heads = kv.shape[4]
    heads = num_kv_heads * group
    expected_kv = kv.clone()
    planned, expected = [], []
    for layer, qkv in enumerate(layers):
        query = qkv[None, 0, :heads]
        key = qkv[None, 1, :num_kv_heads]
        value = qkv[None, 2, :num_kv_heads]
        scale = query.shape[-1] ** -0.5
        module = SimpleNamespace(layer_idx=layer)
        with torch.inference_mode():
            out, _ = attention.expeditor_attention(
                module,  # type: ignore[arg-type]
                query,
                key,
                value,
                None,
                scaling=scale,
                expeditor_meta=meta,
            )
        planned.append(out[0])
        key_cache, value_cache = expected_kv[:, layer, 0], expected_kv[:, layer, 1]
        store_kv_ref(
            key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache,
            meta.slot_mapping,
        )  # fmt: skip
        expected.append(
            paged_attention_cpu(
                query[0].transpose(0, 1),
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                scale,
            )
        )
    return planned, expected, kv, expected_kv


def assert_same(
    planned: list[torch.Tensor],
    expected: list[torch.Tensor],
    kv: torch.Tensor,
    expected_kv: torch.Tensor,
) -> None:
    assert torch.equal(kv.nan_to_num(7.0), expected_kv.nan_to_num(7.0))
    for out, ref in zip(planned, expected, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(4, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_steps_match_the_kernels(
    num_kv_heads: int, group: int, block_size: int, seed: int
) -> None:
    kv, meta, layers = make_step(
        mixed_seqs(seed * 97 + block_size), num_kv_heads, group, 32, block_size, seed
    )
    assert_same(*run_both(kv, meta, layers, group))
    assert meta.cpu_plan is not None


def test_decodes_fold_gqa_heads() -> None:
    """64 decodes, 8 query heads on 2 KV heads: each KV head's query heads attend as one
    head's rows; the same values as the kernels, and as the torch reference."""
    g = torch.Generator().manual_seed(3)
    seqs = [(int(n), 1) for n in torch.randint(1, 401, (64,), generator=g)]
    kv, meta, layers = make_step(seqs, 2, 4, 32, 16, 3)
    planned, expected, kv, expected_kv = run_both(kv, meta, layers, group=4)
    assert_same(planned, expected, kv, expected_kv)
    assert meta.cpu_plan is not None and all(g.fold for g in meta.cpu_plan.groups)
    key_cache, value_cache = kv[:, 1, 0], kv[:, 1, 1]
    query = layers[1][0, :8].transpose(0, 1)
    ref = paged_attention_ref(
        query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, 32**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(planned[1], ref, atol=1e-5, rtol=1e-5)


def test_short_chunks_fold_and_long_ones_do_not() -> None:
    seqs = [(40, 5), (70, 16), (33, 1), (300, 17), (120, 60)]
    kv, meta, layers = make_step(seqs, 2, 4, 32, 4, seed=12)
    assert_same(*run_both(kv, meta, layers, 4))
    assert meta.cpu_plan is not None
    folded = {g.fold for g in meta.cpu_plan.groups if g.max_q > 1}
    assert folded == {True, False}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_steps(dtype: torch.dtype) -> None:
    kv, meta, layers = make_step(mixed_seqs(21), 2, 4, 32, 16, seed=21)
    kv = kv.to(dtype)
    meta.layer_caches = [(kv[:, i, 0], kv[:, i, 1]) for i in range(NUM_LAYERS)]
    layers = [qkv.to(dtype) for qkv in layers]
    planned, expected, kv, expected_kv = run_both(kv, meta, layers, 4)
    assert torch.equal(kv.float().nan_to_num(7.0), expected_kv.float().nan_to_num(7.0))
    for out, ref in zip(planned, expected, strict=True):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lens", [[512, 512, 512, 512], [37, 100, 5], [1], [16, 17]])
def test_whole_prompts_take_sdpa_causal(lens: list[int]) -> None:
    kv, meta, layers = make_step([(n, n) for n in lens], 2, 2, 16, 16, seed=len(lens))
    assert_same(*run_both(kv, meta, layers, 2))
    assert meta.cpu_plan is not None
    assert all(g.causal and g.mask is None for g in meta.cpu_plan.groups)


def test_tokens_without_slots_and_rows_outside_sequences() -> None:
    kv, meta, layers = make_step([(30, 5), (17, 1), (9, 0)], 2, 2, 32, 4, seed=5, lead_rows=3)
    planned, expected, kv, expected_kv = run_both(kv, meta, layers, 2)
    assert_same(planned, expected, kv, expected_kv)
    assert meta.cpu_plan is not None and not meta.cpu_plan.covers_all
    for out in planned:
        assert torch.equal(out[:3], torch.zeros_like(out[:3]))


def test_a_plan_is_built_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    build = attention.plan_cpu_step

    def counting(*args: object) -> attention.CpuStepPlan:
        calls.append(1)
        return build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "plan_cpu_step", counting)
    kv, meta, layers = make_step(mixed_seqs(4), 2, 2, 16, 4, seed=4)
    assert_same(*run_both(kv, meta, layers, 2))
    assert len(calls) == 1


def test_scale_defaults_to_head_dim() -> None:
    kv, meta, layers = make_step([(20, 1), (8, 8)], 1, 2, 16, 4, seed=9)
    qkv = layers[0]
    with torch.inference_mode():
        out, _ = attention.expeditor_attention(
            SimpleNamespace(layer_idx=0),  # type: ignore[arg-type]
            qkv[None, 0, :2],
            qkv[None, 1, :1],
            qkv[None, 2, :1],
            None,
            expeditor_meta=meta,
        )
    ref = paged_attention_cpu(
        qkv[0, :2].transpose(0, 1),
        kv[:, 0, 0],
        kv[:, 0, 1],
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        1 / math.sqrt(16),
    )
    torch.testing.assert_close(out[0], ref, atol=1e-6, rtol=1e-6)


def decode_steps(
    lens: list[int], steps: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """A NaN cache holding each sequence's first ``len - 1`` K/V, block tables long
    enough for ``steps`` more tokens (garbage past them), and each table as a list."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(n + steps) // block_size) for n in lens]
    num_blocks = sum(needed) + 4
    kv = torch.full((num_blocks, NUM_LAYERS, 2, block_size, 2, 16), float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(needed) + 1), 10**6, dtype=torch.int32)
    lists: list[list[int]] = []
    used = 0
    for s, n in enumerate(lens):
        ids = perm[used : used + needed[s]]
        used += needed[s]
        tables[s, : needed[s]] = torch.tensor(ids, dtype=torch.int32)
        lists.append(ids)
        cached = torch.arange(n - 1)
        blocks = torch.tensor(ids)[cached // block_size]
        kv[blocks, :, :, cached % block_size] = torch.randn(
            (n - 1, NUM_LAYERS, 2, 2, 16), generator=g
        )
    return kv, tables, lists


def decode_meta(
    kv: torch.Tensor,
    tables: torch.Tensor,
    lists: list[list[int]],
    lens: list[int],
    block_size: int,
    reuse: attention.DecodeReuse | None,
) -> attention.StepMetadata:
    slots = [lists[s][(n - 1) // block_size] * block_size + (n - 1) % block_size
             for s, n in enumerate(lens)]  # fmt: skip
    return attention.StepMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        layer_caches=[(kv[:, layer, 0], kv[:, layer, 1]) for layer in range(NUM_LAYERS)],
        reuse=reuse,
    )


@pytest.mark.parametrize("lens", [[30, 17, 5, 64, 100, 33], [16, 1, 200, 201, 48]])
def test_decode_steps_reuse_the_gathered_kv(lens: list[int]) -> None:
    """Steps of the same decodes, one token further each (blocks appended on the way):
    the layers keep what they gathered and add the new rows; every step matches the
    kernels on a cache of its own. A replaced block, or another batch, gathers again."""
    block_size, steps = 4, 10
    kv, tables, lists = decode_steps(lens, steps + 2, block_size, seed=len(lens))
    expected_kv = kv.clone()
    reuse = attention.DecodeReuse()
    g = torch.Generator().manual_seed(7)
    reused = 0
    for step in range(steps + 2):
        current = [n + step for n in lens]
        if step == steps:  # copy-on-write: sequence 0's first block is another now
            spare = int(kv.shape[0]) - 1
            kv[spare] = kv[lists[0][0]]
            expected_kv[spare] = expected_kv[lists[0][0]]
            lists[0][0] = spare
            tables[0, 0] = spare
        if step == steps + 1:  # one sequence fewer
            current, tables, lists = current[1:], tables[1:], lists[1:]
        meta = decode_meta(kv, tables, lists, current, block_size, reuse)
        expect_meta = decode_meta(expected_kv, tables, lists, current, block_size, None)
        before = reuse.plan
        for layer in range(NUM_LAYERS):
            qkv = torch.randn((3, 8, len(current), 16), generator=g)
            query, key, value = qkv[None, 0], qkv[None, 1, :2], qkv[None, 2, :2]
            with torch.inference_mode():
                out, _ = attention.expeditor_attention(
                    SimpleNamespace(layer_idx=layer),  # type: ignore[arg-type]
                    query, key, value, None, scaling=0.25, expeditor_meta=meta,
                )  # fmt: skip
            key_cache, value_cache = expected_kv[:, layer, 0], expected_kv[:, layer, 1]
            store_kv_ref(
                key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache,
                expect_meta.slot_mapping,
            )  # fmt: skip
            ref = paged_attention_cpu(
                query[0].transpose(0, 1), key_cache, value_cache, tables,
                expect_meta.seq_lens, expect_meta.query_start_loc, 0.25,
            )  # fmt: skip
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out[0], ref, atol=1e-6, rtol=1e-6)
        was_reused = before is not None and meta.cpu_plan is before
        assert was_reused == all(grp.new_rows is not None for grp in meta.cpu_plan.groups)
        if step >= steps:
            assert not was_reused
        reused += was_reused
    assert torch.equal(kv.nan_to_num(7.0), expected_kv.nan_to_num(7.0))
    assert reused >= steps // 2


def test_steps_without_reuse_state_gather_every_time() -> None:
    kv, tables, lists = decode_steps([20, 9], 2, 4, seed=3)
    meta = decode_meta(kv, tables, lists, [20, 9], 4, None)
    qkv = torch.randn((3, 4, 2, 16))
    with torch.inference_mode():
        attention.expeditor_attention(
            SimpleNamespace(layer_idx=0),  # type: ignore[arg-type]
            qkv[None, 0], qkv[None, 1, :2], qkv[None, 2, :2], None, expeditor_meta=meta,
        )  # fmt: skip
    assert meta.cpu_plan is not None
    assert all(g.new_rows is None and len(g.buffers) == 1 for g in meta.cpu_plan.groups)
