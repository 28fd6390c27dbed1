"""Cache-aware admission: the longest cached prefix first, one prefill warming a shared
prefix for the others, and the bound on how often a request is passed over.

The bound is checked against an oracle of its own: before each step, the waiting
sequences and their keys; after it, for each one still waiting, how many sequences
queued after it were admitted in that step.
"""

from __future__ import annotations

import pytest
from support.harness import BS, Harness, check_outputs

from ipc.schema import SeqStatus
from scheduler_svc.core.cache_aware import SCAN
from scheduler_svc.core.request import Sequence
from scheduler_svc.simulator import Simulation
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig

PREFIX_A = list(range(100, 100 + 6 * BS))
PREFIX_B = list(range(300, 300 + 6 * BS))


def admitted_order(h: Harness) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order: list[str] = []
    for plan in h.plans:
        for seq_id in plan.num_scheduled_tokens:
            request_id = seq_id.split("/", 1)[0]
            if request_id not in order:
                order.append(request_id)
    return order


def warm_then_queue(cache_aware: bool, **config: object) -> Harness:
    """Prefix A cached by a finished request; then, one slot free at a time, a request
    on a new prefix B queued before one on the cached A."""
    h = Harness(
        enable_prefix_caching=True,
        max_num_seqs=1,
        cache_aware_admission=cache_aware,
        **config,
    )
    h.add("warm", [*PREFIX_A, 1, 2, 3], max_tokens=2)
    h.run()
    h.add("cold", [*PREFIX_B, 4, 5], max_tokens=2)
    h.add("hit", [*PREFIX_A, 6, 7], max_tokens=2)
    h.run()
    return h


def test_the_request_with_a_cached_prefix_goes_first() -> None:
    assert admitted_order(warm_then_queue(False)) == ["warm", "cold", "hit"]
    h = warm_then_queue(True)
    assert admitted_order(h) == ["warm", "hit", "cold"]
    assert h.sched.kv.hit_tokens == len(PREFIX_A)
    assert h.sched.admission is not None and h.sched.admission.num_reordered == 1
    for request in h.requests.values():  # and every output is still the model's
        assert request.seqs[0].output_token_ids == h.reference(request)[0]


def test_max_bypass_zero_is_the_static_order() -> None:
    assert admitted_order(warm_then_queue(True, max_bypass=0)) == ["warm", "cold", "hit"]


def test_a_passed_over_request_goes_first_at_the_bound() -> None:
    h = Harness(enable_prefix_caching=True, max_num_seqs=1, cache_aware_admission=True,
                max_bypass=2)  # fmt: skip
    h.add("warm", [*PREFIX_A, 1, 2, 3], max_tokens=1)
    h.run()
    h.add("cold", [*PREFIX_B, 9], max_tokens=1)
    for index in range(4):  # each hits A's blocks; cold's B is never cached
        h.add(f"hit{index}", [*PREFIX_A, 10 + index], max_tokens=1)
    h.run()
    assert admitted_order(h) == ["warm", "hit0", "hit1", "cold", "hit2", "hit3"]
    assert h.requests["cold"].seqs[0].num_bypassed == 2


def test_a_shared_prefix_is_prefilled_once_under_chunked_prefill() -> None:
    """Two requests on one new prefix of 24 blocks, prefilled 8 blocks a step: without
    cache-aware admission both compute it side by side; with it, the second waits for
    the first's chunks and hits every block of the prefix."""
    prefix = list(range(500, 500 + 24 * BS))
    computed = {}
    for cache_aware in (False, True):
        h = Harness(
            enable_prefix_caching=True,
            cache_aware_admission=cache_aware,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=8 * BS,
            num_gpu_blocks=96,
        )
        first = h.add("first", [*prefix, 1, 2], max_tokens=3)
        second = h.add("second", [*prefix, 3, 4], max_tokens=3)
        h.run()
        computed[cache_aware] = sum(plan.total_tokens for plan in h.plans)
        for request in (first, second):
            assert request.seqs[0].output_token_ids == h.reference(request)[0]
        if cache_aware:
            assert h.sched.kv.hit_tokens == len(prefix)
            assert h.sched.admission is not None and h.sched.admission.num_held > 0
    assert computed[False] - computed[True] >= len(prefix) - 8 * BS


def test_the_priority_policy_reorders_within_a_priority_only() -> None:
    h = Harness(enable_prefix_caching=True, max_num_seqs=1, cache_aware_admission=True,
                policy="priority", aging_rate=0.0)  # fmt: skip
    h.add("warm", [*PREFIX_A, 1, 2, 3], max_tokens=1)
    h.run()
    h.add("urgent", [*PREFIX_B, 4], max_tokens=1, priority=0)
    h.add("hit", [*PREFIX_A, 5], max_tokens=1, priority=1)
    h.run()
    assert admitted_order(h) == ["warm", "urgent", "hit"]


class OvertakeOracle:
    """Counts, per sequence, admissions of sequences queued after it while it waited."""

    def __init__(self) -> None:
        self.overtaken: dict[str, int] = {}

    def before(self, waiting: list[Sequence]) -> None:
        self._waiting = [(seq, seq.key) for seq in waiting]

    def after(self) -> None:
        admitted = [
            key for seq, key in self._waiting if seq.status is not SeqStatus.WAITING
        ]  # fmt: skip
        for seq, key in self._waiting:
            if seq.status is SeqStatus.WAITING:
                later = sum(other > key for other in admitted)
                self.overtaken[seq.seq_id] = self.overtaken.get(seq.seq_id, 0) + later


TRACE = generate_trace(
    80,
    seed=5,
    prompt_len=(8, 48),
    output_len=(1, 24),
    arrival_rate=3.0,
    n_choices=(1, 1, 2),
    eos_fraction=0.3,
    shared_prefixes=10,
    shared_prefix_len=24,
)


def run_trace(
    cache_aware: bool, max_bypass: int, overlap: bool = False
) -> tuple[Simulation, OvertakeOracle, object]:
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=48,
        num_cpu_blocks=32,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        max_model_len=128,
        watermark=0.0,
        enable_prefix_caching=True,
        cache_aware_admission=cache_aware,
        max_bypass=max_bypass,
        overlap_scheduling=overlap,
        preemption_mode="recompute" if overlap else "swap",
    )
    sim = Simulation(TRACE, config, verify_kv=True, check_invariants=True, overlap=overlap)
    oracle = OvertakeOracle()
    scheduler = sim.scheduler
    schedule = scheduler.schedule

    def watched_schedule():  # the oracle around every plan
        oracle.before(list(scheduler.waiting))
        plan = schedule()
        oracle.after()
        return plan

    scheduler.schedule = watched_schedule  # type: ignore[method-assign]
    result = sim.run()
    check_outputs(sim, result)
    return sim, oracle, result


@pytest.mark.parametrize(("max_bypass", "overlap"), [(1, False), (3, False), (2, True)])
def test_a_trace_keeps_every_invariant_and_the_bypass_bound(max_bypass: int, overlap: bool) -> None:
    """More shared prefixes than the pool holds, arriving over time (preemption by swap;
    with overlap on, by recompute, so sequences wait with tokens in flight): outputs
    exact, invariants every step, no sequence passed over more than max_bypass times,
    and more prefix hits than the static order gets."""
    static_sim, static_oracle, _ = run_trace(False, max_bypass, overlap)
    assert max(static_oracle.overtaken.values(), default=0) == 0  # the oracle's baseline
    sim, oracle, _ = run_trace(True, max_bypass, overlap)
    assert max(oracle.overtaken.values()) == max_bypass  # reached, never exceeded
    assert sim.scheduler.admission is not None and sim.scheduler.admission.num_reordered > 0
    assert sim.scheduler.kv.hit_tokens > static_sim.scheduler.kv.hit_tokens


def test_the_scan_is_bounded() -> None:
    h = Harness(enable_prefix_caching=True, max_num_seqs=1, cache_aware_admission=True,
                num_gpu_blocks=512, max_model_len=256)  # fmt: skip
    h.add("warm", [*PREFIX_A, 1, 2, 3], max_tokens=1)
    h.run()
    for index in range(SCAN + 1):
        h.add(f"cold{index}", h.model.prompt(f"cold{index}", 8), max_tokens=1)
    h.add("hit", [*PREFIX_A, 5], max_tokens=1)  # beyond the scan until one cold has gone
    h.step()
    assert admitted_order(h)[-1] == "cold0"
    h.step()
    assert admitted_order(h)[-1] == "cold1"
    h.step()  # now within the first SCAN waiting: its cached prefix takes it first
    assert admitted_order(h)[-1] == "hit"
