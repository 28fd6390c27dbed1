"""The torch backend's attention (``paged_attention_ref``, the reference of the other
backends) in its own terms: its grouping and score chunks change nothing, soft-capping
takes the explicit float32 path, half precision stays near float32; against dense
attention in test_kernels.py.

Random caches (NaN wherever no token was stored, so reading a stale slot poisons the
output), shuffled block ids, garbage past each block table's own entries, and mixed
batches: decodes, chunks with cached prefixes, whole prompts, sequences without new
tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from support.attention_cases import mixed_seqs, paged_attention_ref

from gpu_worker.attention import torch_backend

CPU = torch.device("cpu")


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


def float64_attention(batch: Batch, **kwargs: object) -> torch.Tensor:
    """The same attention with everything in float64."""
    args = [x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in batch.args()]
    return paged_attention_ref(*args, **kwargs)  # type: ignore[arg-type]


def assert_close_to_float64(
    batch: Batch, atol: float, rtol: float, **kwargs: object
) -> torch.Tensor:
    out = paged_attention_ref(*batch.args(), **kwargs)  # type: ignore[arg-type]
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all()
    expected = float64_attention(batch, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(4, 1), (2, 4), (1, 8)])
def test_mixed_batches_match_float64(num_kv_heads: int, group: int, block_size: int) -> None:
    seed = num_kv_heads * 1000 + group * 100 + block_size
    batch = make_batch(mixed_seqs(seed), num_kv_heads, group, 32, block_size, torch.float32, seed)
    assert_close_to_float64(batch, 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_near_float32(dtype: torch.dtype) -> None:
    batch = make_batch(mixed_seqs(7), 2, 4, 64, 16, dtype, seed=7)
    # SDPA rounds its inputs' products in the inputs' dtype: a couple of units in the
    # last place of the outputs (|x| < 4).
    assert_close_to_float64(batch, 3e-2, 2e-2)
    assert_close_to_float64(batch, 3e-2, 2e-2, window=24, softcap=1.5)


@pytest.mark.parametrize("elements", [1, 1 << 16])
def test_decode_groups_do_not_change_results(
    monkeypatch: pytest.MonkeyPatch, elements: int
) -> None:
    """One decode per group, or small groups: the same results as one group."""
    g = torch.Generator().manual_seed(3)
    seqs = [(int(n), 1) for n in torch.randint(1, 401, (64,), generator=g)] + [(50, 9)]
    batch = make_batch(seqs, 2, 4, 32, 16, torch.float32, 3)
    whole = paged_attention_ref(*batch.args())
    names = ("query_start_loc", "seq_lens", "block_tables")
    arrays = {n: getattr(batch, n).numpy() for n in names}

    def groups() -> list[torch_backend.Group]:
        return torch_backend.plan_groups(arrays, 16, 64, CPU)

    assert len(groups()) == 2  # the chunk, and every decode together
    monkeypatch.setattr(torch_backend, "GROUP_ELEMENTS", elements)
    torch.testing.assert_close(paged_attention_ref(*batch.args()), whole, atol=1e-6, rtol=1e-6)
    assert sum(g.rows.numel() for g in groups()) == 64 + 9
    assert len(groups()) == 65 if elements == 1 else 2 < len(groups()) < 65


def test_rows_outside_sequences_are_zero_and_empty_batches() -> None:
    batch = make_batch([(30, 5), (17, 1)], 2, 2, 32, 4, torch.float32, seed=5, lead_rows=3)
    out = assert_close_to_float64(batch, 1e-5, 1e-5)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    idle = make_batch([(12, 0)], 2, 2, 32, 4, torch.float32, seed=1, lead_rows=2)
    assert torch.equal(paged_attention_ref(*idle.args()), torch.zeros_like(idle.query))
    none = make_batch([], 2, 2, 32, 4, torch.float32, seed=1)
    assert paged_attention_ref(*none.args()).shape == (0, 4, 32)


def test_rejects_bad_shapes() -> None:
    batch = make_batch([(9, 1)], 2, 2, 32, 4, torch.float32, seed=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_ref(batch.query[:, :3], *batch.args()[1:])


# ---------------------------------------------------------------- window and softcap


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [None, 1, 7, 40, 10_000])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group"), [(16, 2, 4), (4, 4, 1)])
def test_window_softcap(
    block_size: int, num_kv_heads: int, group: int, window: int | None, softcap: float | None
) -> None:
    """Windows of 1, under a block, spanning blocks and beyond every context: rows at
    positions >= window change, the others do not."""
    seed = block_size * 100 + num_kv_heads * 10 + group
    batch = make_batch(
        mixed_seqs(seed, 120), num_kv_heads, group, 32, block_size, torch.float32, seed
    )
    out = assert_close_to_float64(batch, 1e-5, 1e-5, window=window, softcap=softcap)
    if window is not None and softcap is None:
        unwindowed = paged_attention_ref(*batch.args())
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


def test_softcap_in_score_chunks_and_sdpa_only_without_softcap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tiny score chunks (one query row at a time) give the same results; SDPA runs only
    without a softcap."""
    batch = make_batch(mixed_seqs(12, 80), 2, 2, 32, 4, torch.float32, seed=12)
    expected = paged_attention_ref(*batch.args(), window=9, softcap=3.0)
    calls: list[int] = []
    sdpa = torch_backend.F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(torch_backend, "SCORE_ELEMENTS", 1)
    out = paged_attention_ref(*batch.args(), window=9, softcap=3.0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert calls == []
    paged_attention_ref(*batch.args(), window=9)
    assert calls


def test_rejects_bad_window_and_softcap() -> None:
    batch = make_batch([(9, 1)], 2, 2, 32, 4, torch.float32, seed=4)
    with pytest.raises(ValueError, match="window"):
        paged_attention_ref(*batch.args(), window=-3)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention_ref(*batch.args(), softcap=0)
