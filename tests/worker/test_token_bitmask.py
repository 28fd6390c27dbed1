"""gpu_worker.token_bitmask against numpy's bit unpacking, over Hypothesis-drawn masks:
some rows masked and some not, vocabularies shorter than the words' bits and longer
(embedding padding rows: disallowed). On the device ``EXPEDITOR_TEST_DEVICE`` names
(``benchmarks/gpu_check.sh`` runs it on CUDA), default the CPU."""

from __future__ import annotations

import os

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.token_bitmask import apply_bitmask, pack_rows

DEVICE = os.environ.get("EXPEDITOR_TEST_DEVICE", "cpu")


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(-40, 40),
    st.integers(0, 2**31),
)
def test_masked_logits_equal_numpys_unpacked_bits(
    rows: int, words: int, extra: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    vocab = max(1, 32 * words + extra)
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32)).to(DEVICE)
    masks: list[bytes | None] = [
        None
        if rng.random() < 0.3
        else rng.integers(-(2**31), 2**31, words, dtype=np.int64).astype("<i4").tobytes()
        for _ in range(rows)
    ]
    index, bits = pack_rows(masks, words)
    got = apply_bitmask(
        logits, torch.from_numpy(index).to(DEVICE), torch.from_numpy(bits).to(DEVICE)
    ).cpu()
    logits = logits.cpu()
    for r, mask in enumerate(masks):
        if mask is None:
            assert torch.equal(got[r], logits[r])
            continue
        allowed = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.concatenate([allowed, np.zeros(max(0, vocab - allowed.size), np.uint8)])
        want = np.where(allowed[:vocab] == 1, logits[r].numpy(), -np.inf)
        assert np.array_equal(got[r].numpy(), want)
