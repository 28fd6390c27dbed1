"""A trace and a scheduler configuration for the sliding-window tests (one windowed
table, tables of layer groups): windows that end inside blocks, a pool tight enough that
whole contexts preempt."""

from __future__ import annotations

from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.request import Sequence
from scheduler_svc.simulator import SimResult
from shared.config import SchedulerConfig
from support.harness import checked_run, mixed_trace, trace_config

WINDOW = 10
"""Keys a windowed layer reads: ends inside a block of BS (4) tokens."""

TRACE = mixed_trace(seed=5, longest=60)


def window_config(**fields: object) -> SchedulerConfig:
    """The trace tests' scheduler with 64 device blocks, contexts of 160 and prefill
    chunks of 16, unless ``fields`` say otherwise."""
    windowed = {"num_gpu_blocks": 64, "max_model_len": 160, "long_prefill_token_threshold": 16}
    return trace_config(**{**windowed, **fields})


def simulate_windowed(
    cfg: SchedulerConfig,
    *,
    overlap: bool = False,
    acceptance: float | None = None,
    kv_window: int = 0,
    kv_groups: tuple[int, ...] = (),
) -> SimResult:
    """:data:`TRACE` through the scheduler and the fake worker (every K/V slot a window
    reads verified, invariants every step); outputs exact and no block left over."""
    options = {"overlap": overlap, "proposal_acceptance": acceptance}
    return checked_run(TRACE, cfg, **options, kv_window=kv_window, kv_groups=kv_groups)[1]


def grow(kv: KVCacheManager, seq: Sequence, num_new: int) -> list[int]:
    """Schedule and compute ``num_new`` tokens of ``seq`` as the scheduler does: slide,
    then append; returns the entries the slide released."""
    released = kv.slide(seq)
    kv.append(seq, num_new)
    seq.num_computed_tokens += num_new
    return released
