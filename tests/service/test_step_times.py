"""StepTimer: where the steps' time goes (totals and the moving window), fed by the engine."""

from __future__ import annotations

import msgspec
import pytest

from ipc.schema import BatchPlan, StepResult, StepTimes, StepTiming
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.fake_worker import FakeModel, FakeWorker
from scheduler_svc.step_engine import InlineExecutor, StepEngine
from scheduler_svc.step_times import StepTimer
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams

TIMING = StepTiming(swap_s=0.001, forward_s=0.004, sample_s=0.002, total_s=0.010)


def test_an_empty_timer_reports_zeros() -> None:
    timer = StepTimer()
    assert timer.total() == StepTimes() == timer.recent()
    assert timer.total().steps == 0


def test_one_step_splits_into_its_parts_in_milliseconds() -> None:
    timer = StepTimer()
    timer.add_step(0.0005, 0.012, TIMING)
    timer.add_outputs(0.0003)
    times = timer.total()
    assert times.steps == 1
    assert times.schedule == pytest.approx(0.5)
    assert times.transfer == pytest.approx(2.0)  # 12 ms waited, 10 ms in the worker
    assert times.prepare == pytest.approx(3.0)  # 10 - swap 1 - forward 4 - sample 2
    assert (times.swap, times.forward, times.sample) == pytest.approx((1.0, 4.0, 2.0))
    assert times.outputs == pytest.approx(0.3)
    assert timer.recent() == times


def test_differences_below_zero_count_as_zero() -> None:
    timer = StepTimer()
    # the wait shorter than the worker's own total; parts adding up past the total
    timer.add_step(
        0.0, 0.005, StepTiming(swap_s=0.0, forward_s=0.008, sample_s=0.004, total_s=0.01)
    )
    times = timer.total()
    assert times.transfer == 0.0 and times.prepare == 0.0
    # a result without timing (an empty step): the whole wait is transfer
    timer.add_step(0.0, 0.002, StepResult(step=1, sampled_token_ids={}).timing)
    assert timer.total().transfer == pytest.approx(1.0)  # (0 + 2 ms) / 2 steps


def test_the_window_moves_and_the_totals_keep_everything() -> None:
    timer = StepTimer(window=2)
    for core_s in (0.001, 0.002, 0.003, 0.004):
        timer.add_step(core_s, 0.0, StepTiming())
        timer.add_outputs(core_s * 10)
    total, recent = timer.total(), timer.recent()
    assert total.steps == 4 and recent.steps == 2
    assert total.schedule == pytest.approx(2.5)
    assert recent.schedule == pytest.approx(3.5)  # the last two steps only
    assert total.outputs == pytest.approx(25.0) and recent.outputs == pytest.approx(35.0)
    with pytest.raises(ValueError, match="window"):
        StepTimer(window=0)


def test_outputs_and_steps_are_averaged_each_over_their_own_count() -> None:
    timer = StepTimer()
    timer.add_step(0.001, 0.0, StepTiming())
    timer.add_step(0.003, 0.0, StepTiming())
    timer.add_outputs(0.004)  # the output task is one step behind
    assert timer.total().schedule == pytest.approx(2.0)
    assert timer.total().outputs == pytest.approx(4.0)


def test_step_times_encode_as_the_documented_object() -> None:
    timer = StepTimer()
    timer.add_step(0.001, 0.012, TIMING)
    encoded = msgspec.to_builtins(timer.total())
    assert set(encoded) == {
        "schedule",
        "transfer",
        "prepare",
        "swap",
        "forward",
        "sample",
        "outputs",
        "steps",
        "forward_gflops",
    }


def test_the_engine_adds_every_applied_step() -> None:
    config = SchedulerConfig(
        block_size=4, num_gpu_blocks=32, max_num_seqs=4, max_num_batched_tokens=32
    )
    model = FakeModel()
    sched = Scheduler(config, eos_token_ids=[model.eos_token_id], kv_bytes_per_block=1024)
    worker = FakeWorker(model, block_size=4, num_gpu_blocks=32, num_cpu_blocks=0)
    timings = [StepTiming(swap_s=0.0, forward_s=0.001, sample_s=0.0, total_s=0.002)]

    def execute(plan: BatchPlan) -> StepResult:
        return msgspec.structs.replace(worker.execute(plan), timing=timings[0])

    engine = StepEngine(sched, InlineExecutor(execute), check_invariants=True)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    sched.add_request("a", model.prompt("a", 6), params)
    sched.add_request("b", model.prompt("b", 9), params)
    records = []
    while engine.has_work():
        records.append(engine.step())
    times = engine.times.total()
    assert times.steps == len(records) > 0
    assert times.forward == pytest.approx(1.0) and times.prepare == pytest.approx(1.0)
    assert all(r.execute_s >= 0 and r.schedule_s >= 0 and r.update_s >= 0 for r in records)
    assert min(msgspec.structs.asdict(times).values()) >= 0
    assert times.outputs == 0.0  # nobody ran an OutputProcessor here


def test_llm_times_its_steps_and_their_outputs() -> None:
    from expeditor.llm import LLM

    with LLM(num_gpu_blocks=64, max_num_batched_tokens=64) as llm:
        llm.generate([[1, 72, 105], [1, 80]], SamplingParams(temperature=0.0, max_tokens=4))
        timer = llm.engine.times
    assert timer.steps > 0 and timer.outputs_steps == timer.steps
    assert min(msgspec.structs.asdict(timer.total()).values()) >= 0
