"""Admission against the running set: the growth reserve for running sequences' next
block, and resuming swapped sequences before admitting waiting ones (no overtaking).

Scenarios on the real Scheduler stepping a FakeWorker (see tests/core/test_scheduler_unit.py).
"""

from __future__ import annotations

from support.harness import BS, Harness

from ipc.schema import SeqStatus

NO_PREEMPTIONS = {"swap": 0, "recompute": 0}


# --------------------------------------------------------------------------- growth reserve


def test_a_decode_filling_its_block_reserves_its_next_block_against_admission() -> None:
    # 7 + 5 tokens fill the 3-block pool exactly. After its prefill "a" holds 2 blocks;
    # its next decode (position 7, the last slot of block 1) fills that block, so the
    # decode after it needs the one free block: "b" must not take it.
    h = Harness(num_gpu_blocks=3)
    a = h.add("a", 7, max_tokens=5)
    h.step()
    assert a.seqs[0].num_computed_tokens == 7 and h.sched.kv.pool.num_free == 1
    h.add("b", 3, max_tokens=1)
    plan = h.step().plan
    assert a.seqs[0].num_computed_tokens % BS == 0
    assert plan.num_scheduled_tokens == {"a": 1}, "b was admitted into a's reserved block"
    assert h.sched.kv.pool.num_free == 1
    h.step()  # a's decode opens its last block
    assert h.sched.kv.pool.num_free == 0 and h.sched.preemptions == NO_PREEMPTIONS
    h.run()
    assert h.sched.preemptions == NO_PREEMPTIONS, "admitting b cost a preemption"
    h.assert_reference_outputs()


def test_a_prefill_chunk_ending_on_a_block_edge_reserves_the_next_block() -> None:
    # "a" (12 + 4 tokens, the whole 4-block pool) prefills in chunks of 8 and 4. The
    # second chunk ends on a block edge: its first decode needs the one free block.
    h = Harness(num_gpu_blocks=4, max_num_batched_tokens=8)
    a = h.add("a", 12, max_tokens=4)
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 8}
    h.add("b", 4, max_tokens=1)  # one block, and the budget has room for it
    plan = h.step().plan
    assert a.seqs[0].num_computed_tokens == 12 and h.sched.kv.pool.num_free == 1
    assert plan.num_scheduled_tokens == {"a": 4}, "b was admitted into a's reserved block"
    h.run()
    assert h.sched.preemptions == NO_PREEMPTIONS, "admitting b cost a preemption"
    h.assert_reference_outputs()


def test_a_prefill_chunk_inside_a_block_reserves_nothing() -> None:
    # The same, but the second chunk ends inside a block: "a" grows into its own block,
    # so the free block may go to "b" at once.
    h = Harness(num_gpu_blocks=5, max_num_batched_tokens=8)
    a = h.add("a", 11, max_tokens=5)
    h.step()
    h.add("b", 3, max_tokens=2)
    plan = h.step().plan
    assert a.seqs[0].num_computed_tokens == 11 and a.seqs[0].num_computed_tokens % BS
    assert plan.num_scheduled_tokens == {"a": 3, "b": 3}
    h.run()
    assert h.sched.preemptions == NO_PREEMPTIONS
    h.assert_reference_outputs()


def test_the_reserve_counts_every_running_sequence_at_a_block_edge() -> None:
    # Two running sequences each fill their block in the same step: two blocks are
    # reserved, so with two free blocks nothing is admitted; with three, "c" is.
    for free, admitted in ((2, False), (3, True)):
        h = Harness(num_gpu_blocks=4 + free)
        h.add("a", 7, max_tokens=2)
        h.add("b", 7, max_tokens=2)
        h.step()
        assert h.sched.kv.pool.num_free == free
        h.add("c", 2, max_tokens=1)
        plan = h.step().plan
        assert ("c" in plan.num_scheduled_tokens) is admitted, (free, plan.num_scheduled_tokens)
        h.run()
        assert h.sched.preemptions == NO_PREEMPTIONS
        h.assert_reference_outputs()


def test_the_reserve_counts_every_prefill_chunk_ending_on_a_block_edge() -> None:
    # "a" and "b" prefill 12 tokens each in chunks of 8 and 4; their second chunks end
    # on a block edge in the same step: two blocks are reserved.
    for free, admitted in ((2, False), (3, True)):
        h = Harness(num_gpu_blocks=6 + free, long_prefill_token_threshold=8)
        h.add("a", 12, max_tokens=2)
        h.add("b", 12, max_tokens=2)
        plan = h.step().plan
        assert plan.num_scheduled_tokens == {"a": 8, "b": 8}
        h.add("c", 2, max_tokens=1)
        plan = h.step().plan
        assert plan.num_scheduled_tokens["a"] == plan.num_scheduled_tokens["b"] == 4
        assert h.sched.kv.pool.num_free == free
        assert ("c" in plan.num_scheduled_tokens) is admitted, (free, plan.num_scheduled_tokens)
        h.run()
        assert h.sched.preemptions == NO_PREEMPTIONS
        h.assert_reference_outputs()


# --------------------------------------------------------------------------- resume order


def test_a_swapped_sequence_resumes_before_a_later_waiting_request() -> None:
    # "b" is swapped out while "a" grows; "w" arrives later, so it ranks after "b" and
    # must not start while "b" waits in the swap pool, even though it would fit first.
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=32, preemption_mode="swap")
    h.add("a", 8, max_tokens=12)
    b = h.add("b", 8, max_tokens=12)
    while b.seqs[0].status is not SeqStatus.SWAPPED:
        h.step()
    w = h.add("w", 2, max_tokens=2)
    order: list[str] = []
    while h.sched.has_work():
        h.step()
        order += [s for s in h.last.swapped_in if s == "b"]
        if w.seqs[0].status is not SeqStatus.WAITING and "w" not in order:
            order.append("w")
            assert b.seqs[0].status is not SeqStatus.SWAPPED, "w overtook the swapped b"
    assert order == ["b", "w"]
    h.assert_reference_outputs()


def test_a_swapped_sequence_that_does_not_fit_blocks_later_waiting_requests() -> None:
    # While the swapped "b" cannot come back, the small "w" behind it waits too (no
    # overtaking), though one free block would hold it.
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=32, preemption_mode="swap")
    a = h.add("a", 8, max_tokens=12)
    b = h.add("b", 8, max_tokens=12)
    while b.seqs[0].status is not SeqStatus.SWAPPED:
        h.step()
    h.add("w", 2, max_tokens=1)
    waited_with_room = 0
    while b.seqs[0].status is SeqStatus.SWAPPED:
        free = h.sched.kv.pool.num_free
        plan = h.step().plan
        if "b" not in h.last.swapped_in:
            assert "w" not in plan.num_scheduled_tokens, "w overtook the swapped b"
            waited_with_room += free > 0 and a.seqs[0].status is SeqStatus.RUNNING
    assert waited_with_room, "the scenario never had room for w while b was swapped"
    h.run()
    h.assert_reference_outputs()
