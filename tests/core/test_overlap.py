"""Overlapped scheduling: step N+1 is planned before step N's result is applied.

The real core and engine drive a fake worker that checks every plan against its own
state (strict protocol) and every K/V slot attention reads; the worker fills in the
placeholders with the tokens it sampled itself. Outputs must equal the reference of
each sample run alone, and the same run with overlap off.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from support.harness import BS, Harness

from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.fake_worker import FakeWorker
from scheduler_svc.simulator import Simulation, TraceRequest
from scheduler_svc.step_engine import InlineExecutor, StepEngine, StepLostError
from shared.config import SchedulerConfig
from shared.outputs import FinishReason
from shared.sampling import SamplingParams


def make(eos_at: dict[str, int] | None = None, *, overlap: bool = True, **config: object):
    """The harness planning ahead (overlap on), with a swap pool."""
    return Harness(eos_at, overlap_scheduling=overlap, num_cpu_blocks=32, **config)


class Watching:
    """An inline executor that records, for each plan, the core's state when it was
    submitted: how many steps were in flight, which scheduled sequences were planned on
    top of a token not back yet, and how many sequences its planning preempted while a
    token of theirs was in flight."""

    def __init__(self, sched: Scheduler, execute: Callable[[BatchPlan], StepResult]) -> None:
        self.sched = sched
        self.inner = InlineExecutor(execute)
        self.inflight: list[int] = []
        self.on_placeholder: list[set[str]] = []
        self.preempted_in_flight = 0

    def submit(self, plan: BatchPlan) -> Future[StepResult]:
        sched = self.sched
        self.inflight.append(len(sched.inflight))  # this plan's step included
        self.on_placeholder.append(
            {
                seq_id
                for seq_id in plan.num_scheduled_tokens
                if (seq := sched.seqs.get(seq_id)) and seq.num_placeholders == 2
            }
        )
        self.preempted_in_flight += sum(
            1
            for seq_id, _ in sched.inflight[-1].preempted  # the step just planned
            if (seq := sched.seqs.get(seq_id)) and seq.num_placeholders
        )
        return self.inner.submit(plan)


def run(engine: StepEngine, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        assert not engine.step().lost
    raise AssertionError("no end")


def outputs(sched: Scheduler, requests: list) -> dict[str, tuple[list[int], FinishReason]]:
    return {
        seq.seq_id: (seq.output_token_ids, seq.finish_reason)
        for request in requests
        for seq in request.seqs
    }


def test_decodes_are_planned_on_top_of_placeholders_and_stay_exact() -> None:
    results = {}
    for overlap in (True, False):
        h = make(overlap=overlap)
        sched, worker, model = h.sched, h.worker, h.model
        executor = Watching(sched, worker.execute)
        engine = StepEngine(sched, executor, check_invariants=True)
        requests = [
            h.add("a", 9, max_tokens=12),
            h.add("b", 5, max_tokens=7, n=2),
            h.add("c", 30, max_tokens=5),
        ]
        run(engine)
        results[overlap] = outputs(sched, requests)
        for request in requests:
            for seq in request.seqs:
                want = model.reference_output(
                    request.request_id,
                    seq.sample_index,
                    len(request.prompt_token_ids),
                    request.params,
                    128,
                )
                assert (seq.output_token_ids, seq.finish_reason) == want, seq.seq_id
        if overlap:
            assert max(executor.inflight) == 2  # a plan submitted while one was in flight
            planned_ahead = set().union(*executor.on_placeholder)
            assert {"a", "c", "b/0", "b/1"} <= planned_ahead
        else:
            assert set(executor.inflight) == {1}
            assert not any(executor.on_placeholder)
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    assert results[True] == results[False]


def test_no_step_is_planned_past_a_length_limit() -> None:
    """A sequence whose token in flight is its last (max_tokens or max_model_len) waits
    for it: every token it computes is one it needed."""
    h = make(max_model_len=24)
    sched, worker = h.sched, h.worker
    executor = Watching(sched, worker.execute)
    engine = StepEngine(sched, executor, check_invariants=True)
    h.add("short", 6, max_tokens=4, ignore_eos=True)
    h.add("long", 16, max_tokens=None, ignore_eos=True)  # to max_model_len
    scheduled: dict[str, int] = {"short": 0, "long": 0}
    while engine.has_work():
        output = engine.step()
        for seq_id, count in output.plan.num_scheduled_tokens.items():
            scheduled[seq_id] += count
    # prompt + outputs - 1: the last output token is never computed.
    assert scheduled == {"short": 6 + 4 - 1, "long": 24 - 1}
    assert max(executor.inflight) == 2


def test_a_token_after_eos_is_computed_and_dropped() -> None:
    """EOS is only known when its result is back; the step planned meanwhile computes
    one more token of that sequence, which nobody sees."""
    h = make({"e": 3})
    sched, worker, model = h.sched, h.worker, h.model
    engine = StepEngine(sched, InlineExecutor(worker.execute), check_invariants=True)
    request = h.add("e", 7, max_tokens=10)
    while engine.has_work():
        engine.step()
    assert request.seqs[0].output_token_ids[-1] == model.eos_token_id
    assert len(request.seqs[0].output_token_ids) == 3
    assert request.finish_reason is FinishReason.STOP
    assert worker.seqs == {} and sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_abort_between_planned_steps() -> None:
    h = make()
    sched, worker, model = h.sched, h.worker, h.model
    engine = StepEngine(sched, InlineExecutor(worker.execute), check_invariants=True)
    keep = h.add("keep", 8, max_tokens=10)
    gone = h.add("gone", 8, max_tokens=10)
    for _ in range(4):
        engine.step()
    assert sched.inflight  # the next step is planned and holds "gone"
    assert sched.abort("gone")
    run(engine)
    want, _ = model.reference_output("gone", 0, 8, gone.params, 128)
    got = gone.seqs[0].output_token_ids
    assert 0 < len(got) < 10 and got == want[: len(got)]
    assert outputs(sched, [keep])["keep"] == model.reference_output("keep", 0, 8, keep.params, 128)
    assert worker.seqs == {} and sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_preempted_with_a_token_in_flight_keeps_it() -> None:
    """A pool too small for both: the sequence preempted while its token is in flight
    gets that token when the result arrives, and resumes from it."""
    for mode in ("swap", "recompute"):
        h = make(num_gpu_blocks=10, preemption_mode=mode)
        sched, worker, model = h.sched, h.worker, h.model
        executor = Watching(sched, worker.execute)
        engine = StepEngine(sched, executor, check_invariants=True)
        requests = [h.add(rid, 10, max_tokens=14, ignore_eos=True) for rid in "xy"]
        while engine.has_work():
            engine.step()
        assert executor.preempted_in_flight > 0, mode
        assert sched.preemptions[mode] > 0
        for request in requests:
            want = model.reference_output(request.request_id, 0, 10, request.params, 128)
            assert outputs(sched, [request])[request.request_id] == want, mode


class LosingExecutor:
    """Loses step ``lose_at`` (the worker dies in it) and then runs a fresh worker."""

    def __init__(self, make_worker: Callable[[], FakeWorker], lose_at: int) -> None:
        self.make_worker = make_worker
        self.worker = make_worker()
        self.lose_at = lose_at

    def submit(self, plan: BatchPlan) -> Future[StepResult]:
        future: Future[StepResult] = Future()
        if plan.step == self.lose_at:
            self.worker = self.make_worker()  # its cache is gone
            future.set_exception(StepLostError("worker died"))
            return future
        try:
            future.set_result(self.worker.execute(plan))
        except Exception as exc:  # the fresh worker refuses what the lost one held
            future.set_exception(exc)
        return future


def test_a_step_lost_with_the_next_planned_requeues_and_stays_exact() -> None:
    h = make()
    sched, model = h.sched, h.model

    def fresh() -> FakeWorker:
        return FakeWorker(model, block_size=BS, num_gpu_blocks=64, num_cpu_blocks=32)

    executor = LosingExecutor(fresh, lose_at=6)
    engine = StepEngine(sched, executor, check_invariants=True)
    requests = [h.add(f"r{i}", 5 + i, max_tokens=9) for i in range(3)]
    lost = 0
    while engine.has_work():
        output = engine.step()
        if output.lost:
            lost += 1
            assert output.plan.step == 6 and output.quarantined == []
            assert output.tokens == [] and not sched.inflight
    assert lost == 1
    for request in requests:
        want = model.reference_output(
            request.request_id, 0, len(request.prompt_token_ids), request.params, 128
        )
        assert outputs(sched, [request])[request.request_id] == want
    assert executor.worker.seqs == {}


def test_overlap_on_and_off_agree_on_a_trace_under_pressure() -> None:
    trace = [
        TraceRequest(
            id=f"t{i}",
            arrival_step=i % 5,
            prompt_len=8 + (i * 7) % 30,
            max_tokens=4 + (i * 5) % 20,
            n=2 if i % 6 == 0 else 1,
            eos_at=3 if i % 4 == 0 else None,
            priority=i % 3,
        )
        for i in range(24)
    ]
    cfg = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=40,
        num_cpu_blocks=64,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        max_model_len=64,
        watermark=0.0,
        policy="priority",
    )
    results = {}
    for overlap in (False, True):
        sim = Simulation(trace, cfg, verify_kv=True, overlap=overlap)
        result = sim.run()
        assert sum(result.summary["preemptions"].values()) > 0
        results[overlap] = (result.outputs, result.seq_finish_reasons)
    assert results[True] == results[False]


def test_blocks_filled_by_placeholders_are_cached_once_their_tokens_are_known() -> None:
    """A block whose last slot a placeholder fills is registered in the prefix cache
    with the next step, under its real tokens: a follow-up prompt that repeats the
    conversation hits every full block of it."""
    h = make()
    sched, worker = h.sched, h.worker
    engine = StepEngine(sched, InlineExecutor(worker.execute), check_invariants=True)
    first = h.add("turn1", 8, max_tokens=10, ignore_eos=True)
    run(engine)
    history = first.prompt_token_ids + first.seqs[0].output_token_ids  # 18 tokens
    sched.add_request("turn2", [*history, 7, 7], SamplingParams(temperature=0.0, max_tokens=2))
    (new,) = engine.step().plan.new_seqs
    assert (new.seq_id, new.num_computed_tokens) == ("turn2", 16)  # 4 full blocks of 4


def test_a_result_that_arrives_before_a_loss_is_dropped_with_the_cache() -> None:
    """The worker is lost after a step's result arrived and before the engine applied
    it: the loss re-queued everything, so the result is dropped, not applied twice."""
    h = make(overlap=False)
    sched, worker, model = h.sched, h.worker, h.model
    engine = StepEngine(sched, InlineExecutor(worker.execute), check_invariants=True)
    request = h.add("r", 6, max_tokens=5)
    engine.step()
    step = engine._fill()
    assert step.future is not None and step.future.done()  # its result is in
    engine.on_worker_lost()  # seen between the result and its update
    assert not sched.inflight and not engine.futures()  # cleared in the one queue
    dropped = engine._apply(step, step.future.result())
    assert dropped.lost and dropped.tokens == []
    assert request.seqs[0].num_computed_tokens == 0
    worker.state.seqs.clear()  # a fresh worker
    run(engine)
    assert outputs(sched, [request])["r"] == model.reference_output("r", 0, 6, request.params, 128)


def test_nothing_is_planned_past_a_step_that_forks() -> None:
    """The samples of an n>1 request exist only once the step that forks them is back:
    no step is planned on top of it, while a step without forks has one planned on top."""
    h = make()
    sched, worker = h.sched, h.worker
    h.add("solo", 5, max_tokens=6, ignore_eos=True)
    first = sched.schedule()
    assert first is not None and sched.can_plan_ahead()  # no fork: plan ahead
    h.add("pair", 5, max_tokens=6, n=2, temperature=1.0, seed=3, ignore_eos=True)
    second = sched.schedule()
    assert second is not None and second.num_samples == {"pair/0": 2}  # it forks
    assert not sched.can_plan_ahead()
    sched.update(worker.execute(first))
    assert not sched.can_plan_ahead()  # the forking step is still out
    sched.update(worker.execute(second))
    assert sched.can_plan_ahead()
    assert {"pair/0", "pair/1"} <= set(sched.seqs)
