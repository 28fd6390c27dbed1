"""Shared by several test modules (from test_kv_manager.py)."""

from __future__ import annotations

import itertools

from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.request import Request, Sequence
from shared.sampling import SamplingParams

BS = 4


def make_kv(
    num_gpu_blocks: int = 16, num_cpu_blocks: int = 16, *, prefix: bool = True
) -> KVCacheManager:
    return KVCacheManager(
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        enable_prefix_caching=prefix,
    )


def make_seq(tokens: list[int], request_id: str | None = None, *, n: int = 1) -> Sequence:
    arrival = next(_arrivals)
    request = Request(
        request_id or f"r{arrival}",
        list(tokens),
        SamplingParams(temperature=0.0, max_tokens=16, n=n),
        priority=0,
        arrival_step=0,
        arrival_seq=arrival,
        max_output_tokens=16,
    )
    seq = Sequence(request, 0, list(tokens), (0.0, arrival, 0))
    seq.pending_forks = n - 1
    request.seqs.append(seq)
    return seq


def decode(kv: KVCacheManager, seq: Sequence, token: int):
    """Sample ``token`` and run the step that computes it."""
    seq.token_ids.append(token)
    result = kv.append(seq, 1)
    seq.num_computed_tokens += 1
    return result


def expected_refs(kv: KVCacheManager, *seqs: Sequence) -> list[int]:
    counts = [0] * kv.pool.num_blocks
    for seq in seqs:
        for block in seq.block_table:
            counts[block] += 1
    return counts


_arrivals = itertools.count(1)


def make_child(parent: Sequence, sample_index: int) -> Sequence:
    request = parent.request
    child = Sequence(
        request, sample_index, list(parent.token_ids), (0.0, request.arrival_seq, sample_index)
    )
    request.seqs.append(child)
    return child


def prefill(kv: KVCacheManager, seq: Sequence, hits: list[int] | None = None) -> None:
    """Admit ``seq`` and compute its whole prompt in one step, as the scheduler would."""
    hits = kv.find_prefix(seq) if hits is None else hits
    kv.admit(seq, hits)
    kv.append(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
