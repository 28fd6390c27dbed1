"""The prefix cache's host tier: device blocks evicted from the prefix cache are copied
to the CPU pool and copied back on a later hit instead of recomputed.

The fake worker keeps real contents for every device and CPU block and checks every
K/V slot attention reads, so a wrong copy, a copy read after it was overwritten or a
hit on the wrong content fails the run.
"""

from __future__ import annotations

import pytest
from support.harness import BS, Harness, check_outputs

from scheduler_svc.core.host_tier import block_digest
from scheduler_svc.core.introspection import snapshot
from scheduler_svc.simulator import Simulation
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig
from shared.errors import ConfigError

PREFIX = list(range(1000, 1000 + 8 * BS))
"""A system prompt of 8 blocks."""


def evict_then_return(host_blocks: int) -> tuple[Harness, int]:
    """A request on PREFIX, then enough others to push PREFIX out of a 24-block device
    pool, then PREFIX again: the prompt tokens the last one computes."""
    h = Harness(
        enable_prefix_caching=True,
        num_gpu_blocks=24,
        num_cpu_blocks=48,
        prefix_cache_cpu_blocks=host_blocks,
        max_num_seqs=2,
    )
    h.add("first", [*PREFIX, 1, 2, 3], max_tokens=2)
    h.run()
    for index in range(4):  # 4 x 10 blocks through a 24-block pool
        h.add(f"other{index}", h.model.prompt(f"other{index}", 10 * BS - 2), max_tokens=2)
    h.run()
    first = h.requests["first"].seqs[0]
    assert h.sched.kv.find_prefix(first) == []  # evicted from the device
    plans_before = len(h.plans)
    again = h.add("again", [*PREFIX, 4, 5, 6], max_tokens=3)
    h.run()
    computed = (
        sum(plan.num_scheduled_tokens.get("again", 0) for plan in h.plans[plans_before:]) - 2
    )  # its decodes
    assert again.seqs[0].output_token_ids == h.reference(again)[0]
    return h, computed


def test_an_evicted_prefix_comes_back_from_the_host_instead_of_recomputed() -> None:
    h_off, computed_off = evict_then_return(0)
    h, computed = evict_then_return(48)  # room for every block evicted
    assert computed_off == len(PREFIX) + 3  # without the tier: the whole prompt again
    assert computed == 3  # with it: only the new tokens
    host = h.sched.kv.host
    assert host is not None and host.hit_tokens == len(PREFIX) and host.num_demoted >= 8
    copied_in = [pair for plan in h.plans for pair in plan.swap_in]
    assert len(copied_in) == len(PREFIX) // BS
    assert sum(len(plan.swap_out) for plan in h.plans) == host.num_demoted
    assert h_off.sched.kv.host is None
    stats = snapshot(h.sched).prefix_cache  # what inspect shows
    assert (stats.host_hit_tokens, stats.host_blocks) == (len(PREFIX), 48)
    assert stats.host_cached_blocks == host.num_cached > 0


def test_the_least_recently_used_host_blocks_make_room() -> None:
    """A tier of 4 blocks: the 8-block prefix does not fit; the tier keeps its most
    recently evicted blocks and the hit stops where the run of them breaks."""
    h, computed = evict_then_return(4)
    host = h.sched.kv.host
    assert host is not None and host.num_cached <= 4
    assert computed > 3  # not all of PREFIX could come back


@pytest.mark.parametrize("overlap", [False, True], ids=["step-exact", "overlap"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_multi_turn_trace_keeps_every_invariant_with_the_tier(overlap: bool, mode: str) -> None:
    """Shared prefixes that do not all fit the device pool, preemption (by swap too,
    the tier sharing the CPU pool), n>1, aborts: outputs exact, invariants every step,
    host hits, and fewer prompt tokens computed than without the tier."""
    trace = generate_trace(
        70,
        seed=11,
        prompt_len=(20, 60),
        output_len=(1, 20),
        arrival_rate=2.0,
        n_choices=(1, 1, 2),
        eos_fraction=0.3,
        abort_fraction=0.1,
        shared_prefixes=8,
        shared_prefix_len=32,
    )
    computed = {}
    for tier in (0, 24):
        config = SchedulerConfig(
            block_size=BS,
            num_gpu_blocks=48,
            num_cpu_blocks=48,
            prefix_cache_cpu_blocks=tier,
            max_num_seqs=6,
            max_num_batched_tokens=48,
            max_model_len=128,
            watermark=0.0,
            preemption_mode=mode,  # type: ignore[arg-type]
            overlap_scheduling=overlap,
        )
        sim = Simulation(trace, config, verify_kv=True, check_invariants=True, overlap=overlap)
        check_outputs(sim, sim.run())
        kv = sim.scheduler.kv
        computed[tier] = kv.queried_tokens - kv.hit_tokens
        if tier:
            assert kv.host is not None and kv.host.hit_tokens > 0
    assert computed[24] < computed[0]


def test_a_lost_worker_empties_the_tier() -> None:
    h, _ = evict_then_return(48)
    host = h.sched.kv.host
    assert host is not None and host.num_cached
    h.sched.on_worker_lost()
    assert host.num_cached == 0 and not host.cached
    assert h.sched.kv.find_host(h.requests["again"].seqs[0], []) == []


def test_digests_name_the_whole_prefix() -> None:
    tokens = (5, 6, 7, 8)
    assert block_digest(b"", tokens) == block_digest(b"", tokens)
    assert block_digest(block_digest(b"", (1,)), tokens) != block_digest(
        block_digest(b"", (2,)), tokens
    )
    assert len(block_digest(b"", tokens)) == 16


def test_the_tier_is_part_of_the_cpu_pool_and_needs_the_prefix_cache() -> None:
    with pytest.raises(ConfigError, match=r"^prefix_cache_cpu_blocks: must be <= num_cpu_blocks"):
        SchedulerConfig(num_cpu_blocks=8, prefix_cache_cpu_blocks=9)
    with pytest.raises(ConfigError, match="needs enable_prefix_caching"):
        SchedulerConfig(num_cpu_blocks=8, prefix_cache_cpu_blocks=4, enable_prefix_caching=False)
    h = Harness(enable_prefix_caching=True, num_cpu_blocks=10, prefix_cache_cpu_blocks=6)
    assert h.sched.kv.cpu_pool.num_free == 4  # what preemption may swap into


def test_cache_aware_admission_counts_host_hits() -> None:
    """A request whose prefix is on the host goes ahead of one on a new prefix."""
    h = Harness(
        enable_prefix_caching=True,
        num_gpu_blocks=24,
        num_cpu_blocks=48,
        prefix_cache_cpu_blocks=48,
        max_num_seqs=1,
        cache_aware_admission=True,
    )
    h.add("first", [*PREFIX, 1, 2, 3], max_tokens=2)
    for index in range(3):
        h.add(f"other{index}", h.model.prompt(f"other{index}", 10 * BS - 2), max_tokens=2)
    h.run()
    assert h.sched.kv.find_prefix(h.requests["first"].seqs[0]) == []  # on the host only
    start = len(h.plans)
    h.add("cold", h.model.prompt("cold", 6 * BS), max_tokens=1)
    h.add("again", [*PREFIX, 4], max_tokens=1)
    h.run()
    order = [s for plan in h.plans[start:] for s in plan.num_scheduled_tokens]
    assert order.index("again") < order.index("cold")
    assert h.sched.kv.host is not None and h.sched.kv.host.hit_tokens == len(PREFIX)
