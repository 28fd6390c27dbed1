"""gpu_worker.prompt_logprobs against a reference written here (one row at a time, in
plain Python over the LM head's float32 log-softmax), over Hypothesis-drawn batches:
sequences with and without prompt logprobs, prefill chunks from the start, the middle
and the end of the prompt, decodes, widths from 0 to beyond the vocabulary, and LM-head
pieces of any size."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.prompt_logprobs import prompt_logprobs
from gpu_worker.staging import Staging
from ipc.plan_state import ScheduledSeq, WorkerSeq
from shared.outputs import PromptLogprobs
from shared.sampling import SamplingParams

HIDDEN = 6


def reference(
    batch: list[ScheduledSeq], hidden: torch.Tensor, head: torch.Tensor
) -> dict[str, PromptLogprobs]:
    out = {}
    row = 0
    for item in batch:
        seq, width = item.seq, item.seq.sampling.prompt_logprobs
        targets = [t for t in range(item.start + 1, item.end + 1) if t < seq.num_prompt_tokens]
        if width is not None and targets:
            entries, ranks = [], []
            for t in targets:
                logits = [float(v) for v in hidden[row + t - 1 - item.start] @ head]
                top = max(logits)
                norm = top + math.log(sum(math.exp(v - top) for v in logits))
                lp = [v - norm for v in logits]
                token = seq.token_ids[t]
                best = sorted(range(len(lp)), key=lambda i: -lp[i])[:width]
                entries.append({i: lp[i] for i in [token, *best]})
                ranks.append(1 + sum(v > lp[token] for v in lp))
            out[seq.seq_id] = PromptLogprobs(first=targets[0], entries=entries, ranks=ranks)
        row += item.num_tokens
    return out


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[ScheduledSeq], int, int]:
    vocab = draw(st.sampled_from([3, 16, 40]))
    batch = []
    for index in range(draw(st.integers(1, 5))):
        num_prompt = draw(st.integers(1, 12))
        tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=num_prompt + 3,
                               max_size=num_prompt + 3))  # fmt: skip
        start = draw(st.integers(0, len(tokens) - 1))
        num_tokens = draw(st.integers(1, len(tokens) - start))
        width = draw(st.sampled_from([None, 0, 1, 3, 20]))
        seq = WorkerSeq(
            seq_id=f"s{index}", request_id=f"r{index}", sample_index=0, token_ids=tokens,
            num_prompt_tokens=num_prompt, num_computed_tokens=start + num_tokens,
            block_ids=[], sampling=SamplingParams(prompt_logprobs=width),
        )  # fmt: skip
        batch.append(ScheduledSeq(seq, start, num_tokens, 0))
    return batch, vocab, draw(st.integers(1, 8))


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(0, 2**31))
def test_prompt_logprobs_equal_the_reference(drawn, seed: int) -> None:
    batch, vocab, piece_rows = drawn
    generator = torch.Generator().manual_seed(seed)
    rows = sum(item.num_tokens for item in batch)
    hidden = torch.randn(rows, HIDDEN, generator=generator, dtype=torch.float64).float()
    head = torch.randn(HIDDEN, vocab, generator=generator, dtype=torch.float64).float() * 3
    starts = [0]
    for item in batch:
        starts.append(starts[-1] + item.num_tokens)
    staging = Staging(torch.device("cpu"))
    got = prompt_logprobs(batch, starts, hidden, lambda h: h @ head, staging, piece_rows)
    want = reference(batch, hidden, head)
    if not want:
        assert got is None and staging.host_syncs == 0
        return
    assert got is not None and got.keys() == want.keys()
    for seq_id, plp in want.items():
        assert got[seq_id].first == plp.first and got[seq_id].ranks == plp.ranks
        assert [e.keys() for e in got[seq_id].entries] == [e.keys() for e in plp.entries]
        for mine, theirs in zip(got[seq_id].entries, plp.entries, strict=True):
            assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-5)
    assert staging.host_syncs == -(-sum(len(p.entries) for p in want.values()) // piece_rows)


def test_a_chunk_reports_the_positions_it_predicts() -> None:
    """Prefill chunk 4..7 of a 10-token prompt: positions 5..8 (the hidden state of
    position 7 predicts token 8); the last chunk, 8..9, gives position 9 only (what
    follows the prompt's last token is the sampler's)."""
    tokens = list(range(10))
    seq = WorkerSeq(
        seq_id="s", request_id="r", sample_index=0, token_ids=tokens, num_prompt_tokens=10,
        num_computed_tokens=8, block_ids=[], sampling=SamplingParams(prompt_logprobs=0),
    )  # fmt: skip
    hidden = torch.eye(10)
    staging = Staging(torch.device("cpu"))
    middle = prompt_logprobs([ScheduledSeq(seq, 4, 4, 0)], [0, 4], hidden[:4], lambda h: h,
                             staging, 64)  # fmt: skip
    assert middle is not None
    assert middle["s"].first == 5 and [list(e) for e in middle["s"].entries] == [[5], [6], [7], [8]]
    last = prompt_logprobs([ScheduledSeq(seq, 8, 2, 1)], [0, 2], hidden[:2], lambda h: h,
                           staging, 64)  # fmt: skip
    assert last is not None and last["s"].first == 9 and len(last["s"].entries) == 1
