"""Preemption in detail: how many victims, which, what they keep, and what is counted.

Scenarios on the real Scheduler stepping a FakeWorker (see tests/core/test_scheduler_unit.py).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from support.harness import BS, Harness

from ipc.schema import SeqStatus
from scheduler_svc.core.introspection import snapshot


def run_recording(h: Harness) -> list[tuple[str, str]]:
    """Run to the end; every preemption (sequence id, mode) in order."""
    preempted: list[tuple[str, str]] = []
    while h.engine.has_work():
        h.step()
        preempted += h.last.preempted
    return preempted


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemptions_are_counted_once_each_per_mode_and_per_sequence(mode: str) -> None:
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=32, preemption_mode=mode)
    for name in ("a", "b", "c", "d"):
        h.add(name, 6, max_tokens=14)
    preempted = run_recording(h)
    per_seq = Counter(seq_id for seq_id, _ in preempted)
    assert max(per_seq.values()) >= 2, "the scenario should preempt one sequence twice"
    assert {m for _, m in preempted} == {mode}
    assert h.sched.preemptions == {"swap": 0, "recompute": 0, mode: len(preempted)}
    for request in h.requests.values():
        assert request.seqs[0].num_preemptions == per_seq[request.request_id]
    h.assert_reference_outputs()


def test_a_sequence_preempted_to_recompute_keeps_no_computed_tokens() -> None:
    h = Harness(num_gpu_blocks=8, preemption_mode="recompute")
    h.add("a", 8, max_tokens=12)
    b = h.add("b", 8, max_tokens=12).seqs[0]
    while not h.step().preempted:
        pass
    assert h.last.preempted == [("b", "recompute")]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_output_tokens > 0  # its tokens are kept
    info = {s.seq_id: s for s in snapshot(h.sched).seqs}["b"]
    assert (info.num_computed_tokens, info.num_gpu_blocks, info.num_preemptions) == (0, 0, 1)
    h.run()
    h.assert_reference_outputs()


def test_a_chunk_needing_exactly_the_free_blocks_preempts_nobody() -> None:
    # "a" prefills 12 tokens in chunks of 8 and 4 (plus 1 token of "b" per step); "b"
    # holds one block. The second chunk of "a" needs the last free block: it fits.
    h = Harness(num_gpu_blocks=4, max_num_batched_tokens=9, long_prefill_token_threshold=8)
    a = h.add("a", 12, max_tokens=4)
    h.add("b", 1, max_tokens=3)
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 8, "b": 1}
    assert h.sched.kv.pool.num_free == 1
    plan = h.step().plan
    assert h.last.preempted == []
    assert plan.num_scheduled_tokens == {"a": 4, "b": 1}
    assert h.sched.kv.pool.num_free == 0 and a.seqs[0].num_computed_tokens == 12
    h.run()
    h.assert_reference_outputs()


# --------------------------------------------------------------------------- making room


def test_making_room_preempts_just_enough_for_a_free_sequence_slot() -> None:
    h = Harness(policy="priority", max_num_seqs=2)
    h.add("low1", 6, max_tokens=8, priority=5)
    h.add("low2", 6, max_tokens=8, priority=5)
    h.step()
    h.add("vip", 6, max_tokens=2, priority=0)
    plan = h.step().plan
    assert h.last.preempted == [("low2", "recompute")]
    assert set(plan.num_scheduled_tokens) == {"vip", "low1"}
    h.run()
    h.assert_reference_outputs()


def test_making_room_counts_the_prefix_hits_of_the_arrival() -> None:
    # "vip" shares its first two blocks with the running "low1": it needs one new
    # block, so one victim ("low2", the lowest ranked, 2 blocks) makes enough room.
    h = Harness(num_gpu_blocks=6, policy="priority")
    shared = h.model.prompt("shared", 2 * BS)
    h.add("low1", [*shared, 11, 12, 13, 14], max_tokens=4, priority=5)
    h.add("low2", BS, max_tokens=4, priority=5)
    h.step()
    h.step()  # both open a new block: the pool is full
    assert h.sched.kv.pool.num_free == 0
    h.add("vip", [*shared, 21, 22, 23, 24], max_tokens=2, priority=0)
    plan = h.step().plan
    assert h.last.preempted == [("low2", "recompute")]
    assert h.last.prefix_hit_tokens == {"vip": 2 * BS}
    assert plan.num_scheduled_tokens["vip"] == BS
    h.run()
    h.assert_reference_outputs()


def test_a_swapped_sequence_first_in_line_does_not_preempt_capped_ones() -> None:
    # max_preemptions=1. "low" is preempted once (capped); "mid", ranked before it, is
    # then the victim for "vip2" and is swapped out while "low" runs on. "mid" is first
    # in line but may not take room from the capped "low": it waits for free blocks.
    h = Harness(
        num_gpu_blocks=10,
        num_cpu_blocks=32,
        policy="priority",
        preemption_mode="swap",
        max_preemptions=1,
    )
    low = h.add("low", 12, max_tokens=16, priority=5).seqs[0]
    h.step()
    h.add("vip1", 32, max_tokens=2, priority=0)  # 8 blocks: only 7 are free
    h.step()
    assert h.last.preempted == [("low", "swap")] and low.num_preemptions == 1
    while low.status is not SeqStatus.RUNNING:
        h.step()
    mid = h.add("mid", 8, max_tokens=16, priority=3).seqs[0]
    h.step()
    assert mid.status is SeqStatus.RUNNING
    h.add("vip2", 20, max_tokens=2, priority=0)
    h.step()
    assert h.last.preempted == [("mid", "swap")]
    assert low.status is SeqStatus.RUNNING
    while mid.status is SeqStatus.SWAPPED:
        h.step()
        assert h.last.preempted == [], "a capped sequence was preempted"
    h.run()
    h.assert_reference_outputs()


def test_a_prefill_that_preempts_itself_is_not_restarted_in_the_same_step() -> None:
    # "p" (12 tokens) prefills in budget-sized chunks next to "a". Its second chunk
    # needs two blocks with one free: it preempts itself (nobody ranks after it). Its
    # block comes back, and a restart (7 tokens, 2 blocks) would fit, but a step that
    # preempted admits nobody: "p" starts over in the next step.
    h = Harness(num_gpu_blocks=4, max_num_batched_tokens=8, preemption_mode="recompute")
    h.add("a", 5, max_tokens=3)
    p = h.add("p", 12, max_tokens=4).seqs[0]
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 5, "p": 3} and h.sched.kv.pool.num_free == 1
    plan = h.step().plan
    assert h.last.preempted == [("p", "recompute")]
    assert plan.num_scheduled_tokens == {"a": 1}, "p was restarted in the step it was preempted"
    assert p.status is SeqStatus.WAITING and h.sched.kv.pool.num_free == 2
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 1, "p": 7}
    h.run()
    h.assert_reference_outputs()


@pytest.mark.parametrize("seed", [25, 26, 28, 29, 31, 32, 33])
def test_a_step_that_preempts_admits_nobody(seed: int) -> None:
    # Seeded random workloads under pressure (FCFS: only the running loop preempts):
    # the blocks a preemption frees go to the running sequence that needed them, and
    # no queued sequence, the victim included, starts in that step.
    rng = random.Random(seed)
    h = Harness(
        num_gpu_blocks=rng.randint(9, 16),
        num_cpu_blocks=64,
        preemption_mode=rng.choice(["swap", "recompute"]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
    )
    for index in range(rng.randint(3, 7)):
        h.add(f"r{index}", rng.randint(2, 14), max_tokens=rng.randint(4, 20))
    preemptions = 0
    while h.engine.has_work():
        report = h.step()
        plan = report.plan
        if report.preempted:
            preemptions += 1
            assert report.swapped_in == [] and report.prefix_hit_tokens == {}, report
            assert plan.new_seqs == [] and plan.swap_in == []
    assert preemptions, "these workloads preempt"
    h.assert_reference_outputs()
