"""A worker lost while a step that moves K/V between the pools was in flight: the
scheduler's block accounting must come out whole, and every request still finishes
with its reference output.

Scenarios on the real Scheduler stepping a FakeWorker (see tests/core/test_scheduler_unit.py).
"""

from __future__ import annotations

import pytest
from support.harness import Harness, restart_worker

from ipc.schema import BatchPlan, SeqStatus
from scheduler_svc.core.introspection import check_invariants


def swap_harness(**config: object) -> Harness:
    """Two requests that outgrow the 8-block pool together: one is swapped out, then in."""
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=32, preemption_mode="swap", **config)
    h.add("a", 8, max_tokens=12)
    h.add("b", 8, max_tokens=12)
    return h


def run_until_a_plan_swaps_in(h: Harness) -> tuple[BatchPlan, list[int]]:
    """Step until a plan resumes a swapped sequence; return that plan, not executed,
    and the CPU blocks the resumed sequence held (those its copies read, and those
    whose content the device cache still had)."""
    for _ in range(200):
        held = {s.seq_id: list(s.cpu_block_table) for s in h.sched.swapped}
        plan = h.sched.schedule()
        assert plan is not None
        swapped_in = h.sched.inflight[-1].swapped_in  # the step just planned
        if swapped_in:
            assert plan.swap_in
            return plan, [b for seq_id in swapped_in for b in held[seq_id]]
        h.sched.update(h.worker.execute(plan))
        assert check_invariants(h.sched) == []
    raise AssertionError("no plan swapped anything in")


def test_worker_lost_while_a_swap_in_was_in_flight_releases_its_cpu_blocks() -> None:
    h = swap_harness()
    plan, held = run_until_a_plan_swaps_in(h)
    b = h.requests["b"].seqs[0]
    assert b.status is SeqStatus.RUNNING and b.cpu_block_table == []
    assert {cpu for cpu, _ in plan.swap_in} <= set(held)
    assert sorted(h.sched.cpu_release) == sorted(held)  # freed when the step is done
    h.sched.on_worker_lost()  # the plan above never ran
    restart_worker(h)
    assert check_invariants(h.sched) == []
    assert h.sched.kv.cpu_pool.num_free == h.cfg.num_cpu_blocks, "swap-in CPU blocks leaked"
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0  # recomputed
    h.run()
    h.assert_reference_outputs()
    assert h.sched.kv.cpu_pool.num_free == h.cfg.num_cpu_blocks
    assert h.sched.kv.pool.num_free == h.cfg.num_gpu_blocks


def test_worker_lost_with_two_steps_in_flight_after_a_swap_in() -> None:
    # Overlapped scheduling: the swap-in step and the one planned behind it are both
    # lost; the CPU blocks of the swap-in are released once, not twice.
    h = swap_harness(overlap_scheduling=True)
    _, held = run_until_a_plan_swaps_in(h)
    assert h.sched.can_plan_ahead()
    ahead = h.sched.schedule()
    assert ahead is not None and len(h.sched.inflight) == 2
    assert sorted(h.sched.cpu_release) == sorted(held)
    h.sched.on_worker_lost()
    restart_worker(h)
    assert check_invariants(h.sched) == []
    assert h.sched.kv.cpu_pool.num_free == h.cfg.num_cpu_blocks
    h.run()
    h.assert_reference_outputs()


@pytest.mark.parametrize("executed", [True, False])
def test_a_swap_in_result_releases_its_cpu_blocks_exactly_once(executed: bool) -> None:
    # The CPU blocks of a swap-in are held until its step's result arrives (the copies
    # read them), then released; a worker lost after that releases nothing more.
    h = swap_harness()
    plan, held = run_until_a_plan_swaps_in(h)
    assert h.sched.kv.cpu_pool.num_free == h.cfg.num_cpu_blocks - len(held)
    if executed:
        h.sched.update(h.worker.execute(plan))
        assert h.sched.cpu_release == []
        assert h.sched.kv.cpu_pool.num_free == h.cfg.num_cpu_blocks
    h.sched.on_worker_lost()
    restart_worker(h)
    assert check_invariants(h.sched) == []
    assert h.sched.kv.cpu_pool.num_free == h.cfg.num_cpu_blocks
    h.run()
    h.assert_reference_outputs()
