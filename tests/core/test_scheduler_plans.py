"""What each plan and step output say besides the tokens: the reset flag after a lost
worker, the step numbers, when a request was first scheduled, and the plans made ahead
with a step in flight (overlapped scheduling), which skip a sequence waiting for its
last token without holding back the others, and still carry what the workers must drop.

Scenarios on the real Scheduler with the fake worker.
"""

from __future__ import annotations

from support.harness import Harness, restart_worker


def test_only_the_plan_after_a_lost_worker_tells_workers_to_reset() -> None:
    h = Harness()
    h.add("a", 6, max_tokens=6)
    plan = h.step().plan
    assert plan.reset is False
    plan = h.step().plan
    assert plan.reset is False
    h.sched.on_worker_lost()
    restart_worker(h)
    plan = h.step().plan
    assert plan.reset is True
    plan = h.step().plan
    assert plan.reset is False
    h.run()
    h.assert_reference_outputs()


def test_outputs_and_plans_are_numbered_by_step() -> None:
    h = Harness()
    assert not h.sched.inflight  # nothing planned yet
    assert h.sched.last_plan_tokens == 0 and h.sched.step == 0
    h.add("a", 6, max_tokens=3)
    for index in range(3):
        plan = h.step().plan
        assert plan.step == index
        assert h.sched.step == index + 1
        assert h.sched.last_plan_tokens == plan.total_tokens


def test_first_scheduled_step_is_kept_through_preemption() -> None:
    h = Harness(num_gpu_blocks=8, preemption_mode="recompute")
    a = h.add("a", 8, max_tokens=12)
    h.step()
    b = h.add("b", 8, max_tokens=12)
    c = h.add("c", 4, max_tokens=2)
    assert b.first_scheduled_step is None
    h.step()
    assert (a.first_scheduled_step, b.first_scheduled_step) == (0, 1)
    preempted = []
    while h.sched.has_work():
        h.step()
        preempted += h.last.preempted
    assert ("b", "recompute") in preempted
    assert (a.first_scheduled_step, b.first_scheduled_step) == (0, 1)
    assert c.first_scheduled_step is not None and c.first_scheduled_step >= 1
    h.assert_reference_outputs()


# --------------------------------------------------------------------------- planned ahead


def test_a_sequence_waiting_for_its_last_token_does_not_hold_back_the_others() -> None:
    h = Harness(overlap_scheduling=True, num_cpu_blocks=32)
    sched, worker = h.sched, h.worker
    h.add("short", 6, max_tokens=2, ignore_eos=True)
    h.add("long", 6, max_tokens=8, ignore_eos=True)
    first = sched.schedule()
    ahead = sched.schedule()  # on top of the tokens of the first step
    assert first is not None and ahead is not None
    sched.update(worker.execute(first))
    # "short" has its last token in flight: it waits; "long", after it, goes on.
    plan = sched.schedule()
    assert plan is not None
    assert plan.num_scheduled_tokens == {"long": 1}
    sched.update(worker.execute(ahead))
    sched.update(worker.execute(plan))
    assert sched.requests.keys() == {"long"}


def test_a_plan_ahead_carrying_only_sequences_to_drop_is_sent() -> None:
    h = Harness(overlap_scheduling=True, num_cpu_blocks=32)
    sched, worker = h.sched, h.worker
    h.add("short", 6, max_tokens=2, ignore_eos=True)
    h.add("gone", 6, max_tokens=8, ignore_eos=True)
    first = sched.schedule()
    ahead = sched.schedule()
    assert first is not None and ahead is not None
    sched.update(worker.execute(first))
    assert sched.abort("gone")
    # Nothing to compute ("short" waits for its last token), but the workers must
    # drop "gone".
    plan = sched.schedule()
    assert plan is not None, "the frees were held back"
    assert plan.num_scheduled_tokens == {} and plan.freed_seq_ids == ["gone"]
    sched.update(worker.execute(ahead))
    sched.update(worker.execute(plan))
    assert not sched.requests and sched.has_work()  # "short" is done: drop it too
    last = sched.schedule()
    assert last is not None and last.freed_seq_ids == ["short"]
    sched.update(worker.execute(last))
    assert worker.seqs == {} and not sched.has_work()


def test_nothing_to_send_while_a_step_is_in_flight_gives_no_plan() -> None:
    h = Harness(overlap_scheduling=True, num_cpu_blocks=32)
    sched, worker = h.sched, h.worker
    h.add("short", 6, max_tokens=2, ignore_eos=True)
    first = sched.schedule()
    ahead = sched.schedule()
    assert first is not None and ahead is not None
    sched.update(worker.execute(first))
    assert sched.schedule() is None  # "short" waits; nothing else to do
    sched.update(worker.execute(ahead))
    assert not sched.requests
    last = sched.schedule()
    assert last is not None and last.freed_seq_ids == ["short"]
    assert last.num_scheduled_tokens == {}
