"""A trace and a scheduler configuration for the sliding-window tests (one windowed
table, tables of layer groups): windows that end inside blocks, a pool tight enough that
whole contexts preempt."""

from __future__ import annotations

from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.request import Sequence
from scheduler_svc.simulator import SimResult, Simulation
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig
from support.harness import BS, check_outputs

WINDOW = 10
"""Keys a windowed layer reads: ends inside a block of BS (4) tokens."""

TRACE = generate_trace(
    60,
    seed=5,
    prompt_len=(4, 60),
    output_len=(1, 60),
    arrival_rate=4.0,
    n_choices=(1, 1, 3),
    eos_fraction=0.3,
    abort_fraction=0.1,
    shared_prefixes=3,
    shared_prefix_len=12,
)


def window_config(**fields: object) -> SchedulerConfig:
    """64 device and 48 CPU blocks of BS tokens unless ``fields`` say otherwise."""
    base: dict[str, object] = {
        "block_size": BS,
        "num_gpu_blocks": 64,
        "num_cpu_blocks": 48,
        "max_num_seqs": 12,
        "max_num_batched_tokens": 48,
        "max_model_len": 160,
        "watermark": 0.0,
        "long_prefill_token_threshold": 16,
    }
    base.update(fields)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


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
    sim = Simulation(
        TRACE,
        cfg,
        verify_kv=True,
        check_invariants=True,
        overlap=overlap,
        proposal_acceptance=acceptance,
        kv_window=kv_window,
        kv_groups=kv_groups,
    )
    result = sim.run()
    check_outputs(sim, result)
    assert result.summary["leftover_blocks"] == {"gpu_in_use": 0, "cpu_in_use": 0}
    return result


def grow(kv: KVCacheManager, seq: Sequence, num_new: int) -> list[int]:
    """Schedule and compute ``num_new`` tokens of ``seq`` as the scheduler does: slide,
    then append; returns the entries the slide released."""
    released = kv.slide(seq)
    kv.append(seq, num_new)
    seq.num_computed_tokens += num_new
    return released
