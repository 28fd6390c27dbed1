"""The CPU paged-attention path against the torch reference.

Random caches (NaN wherever no token was stored, so reading a stale slot poisons the
output), shuffled block ids, garbage past each block table's own entries, and mixed
batches: decodes, chunks with cached prefixes, whole prompts, sequences without new
tokens.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import pytest
import torch
from support.attention_cases import mixed_seqs

from gpu_worker.kernels import paged_attention, paged_attention_cpu, paged_attention_ref

CPU_MOD = importlib.import_module("gpu_worker.kernels.cpu_attention")
ATTN_MOD = importlib.import_module("gpu_worker.kernels.paged_attention")


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

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


def make_batch(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    lead_rows: int = 0,
) -> Batch:
    """``seqs``: (context length incl. new tokens, new tokens) per sequence. The cache is
    one layer of a two-layer ``[blocks, layers, 2, block_size, kv_heads, head_dim]``
    tensor, as in the worker (strided views). ``lead_rows`` query rows precede the
    first sequence's."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(needed) + 3
    kv_cache = torch.full(
        (num_blocks, 2, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    key_cache, value_cache = kv_cache[:, 1, 0], kv_cache[:, 1, 1]
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(seqs), max(needed, default=0) + 2), 10**6, dtype=torch.int32)
    used = 0
    for s, (seq_len, _) in enumerate(seqs):
        ids = perm[used : used + needed[s]]
        used += needed[s]
        block_tables[s, : needed[s]] = ids.to(torch.int32)
        pos = torch.arange(seq_len)
        blocks, offsets = ids[pos // block_size], pos % block_size
        shape = (seq_len, num_kv_heads, head_dim)
        key_cache[blocks, offsets] = torch.randn(shape, generator=g).to(dtype)
        value_cache[blocks, offsets] = torch.randn(shape, generator=g).to(dtype)
    q_lens = torch.tensor([q_len for _, q_len in seqs], dtype=torch.int32)
    query_start_loc = torch.full((len(seqs) + 1,), lead_rows, dtype=torch.int32)
    query_start_loc[1:] += torch.cumsum(q_lens, 0, dtype=torch.int32)
    num_tokens = lead_rows + int(q_lens.sum())
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=g).to(dtype)
    return Batch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int32),
        query_start_loc=query_start_loc,
        scale=1.0 / math.sqrt(head_dim),
    )


def assert_matches_reference(batch: Batch, atol: float, rtol: float) -> torch.Tensor:
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_cpu(*batch.args())
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(4, 1), (4, 2), (2, 4), (1, 8)])
def test_mixed_batches_match_reference(
    num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    seed = num_kv_heads * 1000 + group * 100 + head_dim + block_size
    batch = make_batch(
        mixed_seqs(seed), num_kv_heads, group, head_dim, block_size, torch.float32, seed
    )
    assert_matches_reference(batch, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 4), (1, 8)])
def test_half_precision_matches_reference(
    dtype: torch.dtype, num_kv_heads: int, group: int
) -> None:
    batch = make_batch(mixed_seqs(7), num_kv_heads, group, 64, 16, dtype, seed=7)
    # The reference attends in float32 and rounds once; SDPA rounds its inputs' products
    # differently: a couple of units in the last place of the outputs (|x| < 4).
    assert_matches_reference(batch, atol=3e-2, rtol=2e-2)


def test_decode_batch_like_the_microbenchmark() -> None:
    """64 decodes, contexts 100-400, 8 heads on 2 KV heads: the shape the path is for."""
    g = torch.Generator().manual_seed(3)
    seqs = [(int(n), 1) for n in torch.randint(100, 401, (64,), generator=g)]
    assert_matches_reference(make_batch(seqs, 2, 4, 64, 16, torch.float32, 3), 1e-5, 1e-5)


@pytest.mark.parametrize(("slack", "elements"), [(1.0, 1 << 23), (math.inf, 1), (1.5, 1 << 12)])
def test_grouping_does_not_change_results(
    monkeypatch: pytest.MonkeyPatch, slack: float, elements: int
) -> None:
    """Exact padding only, one sequence per group, or small groups: the same results."""
    monkeypatch.setattr(CPU_MOD, "_PAD_SLACK", slack)
    monkeypatch.setattr(CPU_MOD, "_GROUP_ELEMENTS", elements)
    batch = make_batch(mixed_seqs(11), 2, 4, 32, 4, torch.float32, seed=11)
    assert_matches_reference(batch, atol=1e-5, rtol=1e-5)


def test_groups_bound_padding_and_size() -> None:
    lens = [400, 390, 300, 150, 100, 120, 50]
    q_lens = [1, 1, 1, 1, 1, 1, 50]
    groups = CPU_MOD.group_sequences(list(range(len(lens))), q_lens, lens, 1, 1)
    assert sorted(s for group in groups for s in group) == list(range(len(lens)))
    assert groups[0] == [6]  # the prompt (50 x 50) apart from the decodes
    for group in groups:
        area = sum(q_lens[s] * lens[s] for s in group)
        padded = len(group) * max(q_lens[s] for s in group) * max(lens[s] for s in group)
        assert padded <= CPU_MOD._PAD_SLACK * area


def test_rows_outside_sequences_are_zero_and_scratch_is_reused() -> None:
    batch = make_batch([(30, 5), (17, 1)], 2, 2, 32, 4, torch.float32, seed=5, lead_rows=3)
    out = assert_matches_reference(batch, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    # A second, smaller batch reads the same scratch buffers: nothing stale leaks in.
    small = make_batch([(9, 1), (6, 6)], 2, 2, 32, 4, torch.float32, seed=6)
    assert_matches_reference(small, atol=1e-5, rtol=1e-5)


def test_scratch_from_inference_mode_is_reused_outside() -> None:
    """The engine runs under inference mode, tests and tools may not: either order."""
    CPU_MOD.SCRATCH._buffers.clear()
    big = make_batch([(300, 1), (200, 20)], 2, 2, 32, 4, torch.float32, seed=8)
    with torch.inference_mode():
        assert_matches_reference(big, atol=1e-5, rtol=1e-5)
    assert_matches_reference(big, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        assert_matches_reference(big, atol=1e-5, rtol=1e-5)


def test_empty_batches() -> None:
    batch = make_batch([(12, 0)], 2, 2, 32, 4, torch.float32, seed=1, lead_rows=2)
    assert torch.equal(paged_attention_cpu(*batch.args()), torch.zeros_like(batch.query))
    none = make_batch([], 2, 2, 32, 4, torch.float32, seed=1)
    assert paged_attention_cpu(*none.args()).shape == (0, 4, 32)


def test_dispatch_takes_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXPEDITOR_FORCE_TRITON", raising=False)
    called: list[str] = []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        called.append("cpu")
        return paged_attention_cpu(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ATTN_MOD, "paged_attention_cpu", spy)
    monkeypatch.setattr(ATTN_MOD, "paged_attention_ref", None)
    batch = make_batch([(20, 4), (9, 1)], 2, 2, 32, 4, torch.float32, seed=2)
    paged_attention(*batch.args())
    assert called == ["cpu"]


def test_rejects_bad_shapes() -> None:
    batch = make_batch([(9, 1)], 2, 2, 32, 4, torch.float32, seed=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_cpu(batch.query[:, :3], *batch.args()[1:])


# ---------------------------------------------------------------- window and softcap


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [None, 1, 7, 40, 10_000])
@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group"), [(16, 2, 4), (4, 4, 1), (16, 1, 8)]
)
def test_window_softcap_match_reference(
    block_size: int, num_kv_heads: int, group: int, window: int | None, softcap: float | None
) -> None:
    """Mixed batches (decodes, chunks after cached prefixes, whole prompts, an idle
    sequence) with windows of 1, under a block, spanning blocks and beyond every context."""
    seed = block_size * 100 + num_kv_heads * 10 + group
    batch = make_batch(
        mixed_seqs(seed, 120), num_kv_heads, group, 32, block_size, torch.float32, seed
    )
    expected = paged_attention_ref(*batch.args(), window=window, softcap=softcap)
    out = paged_attention_cpu(*batch.args(), window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if window is not None and softcap is None:
        unwindowed = paged_attention_cpu(*batch.args())
        starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        pos = torch.full((batch.query.shape[0],), -1)
        for s, seq_len in enumerate(lens):
            pos[starts[s] : starts[s + 1]] = torch.arange(
                seq_len - starts[s + 1] + starts[s], seq_len
            )
        cut = pos >= window
        assert cut.any() == (window < 100)
        assert ((out[cut] - unwindowed[cut]).abs().amax(dim=(1, 2)) > 1e-2).all()
        torch.testing.assert_close(out[~cut], unwindowed[~cut], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_softcap_half_precision(dtype: torch.dtype) -> None:
    batch = make_batch(mixed_seqs(9, 120), 2, 4, 64, 16, dtype, seed=9)
    expected = paged_attention_ref(*batch.args(), window=24, softcap=1.5)
    out = paged_attention_cpu(*batch.args(), window=24, softcap=1.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)


def test_softcap_in_score_chunks_and_sdpa_only_without_softcap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tiny score chunks (one query row at a time) give the same results; SDPA runs only
    without a softcap."""
    batch = make_batch(mixed_seqs(12, 80), 2, 2, 32, 4, torch.float32, seed=12)
    expected = paged_attention_cpu(*batch.args(), window=9, softcap=3.0)
    calls: list[int] = []
    sdpa = CPU_MOD.F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(CPU_MOD.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(CPU_MOD, "_SCORE_ELEMENTS", 1)
    out = paged_attention_cpu(*batch.args(), window=9, softcap=3.0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert calls == []
    paged_attention_cpu(*batch.args(), window=9)
    assert calls


def test_rejects_bad_window_and_softcap() -> None:
    batch = make_batch([(9, 1)], 2, 2, 32, 4, torch.float32, seed=4)
    with pytest.raises(ValueError, match="window"):
        paged_attention_cpu(*batch.args(), window=-3)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention_cpu(*batch.args(), softcap=0)
    assert CPU_MOD.check_window_softcap(None, None) == (0, 0.0)
    assert CPU_MOD.check_window_softcap(4096, 50) == (4096, 50.0)
