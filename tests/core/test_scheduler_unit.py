"""Deterministic scenarios: the real Scheduler stepping a FakeWorker that verifies K/V.

Every step is a :class:`StepEngine` step (schedule, the fake worker, update) that checks
the scheduler's invariants after planning and after the update; the plan's budgets are
checked after it. Tests of one interleaving (a step lost, an abort while a step runs)
call the core directly.
"""

from __future__ import annotations

import pytest
from support.harness import BS, Harness, rejected, restart_worker

from ipc.schema import ErrorCode, SeqStatus, StepResult
from scheduler_svc.core.introspection import check_invariants, snapshot
from scheduler_svc.core.request import RejectedError, Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import WorkerProtocolError
from shared.config import SchedulerConfig
from shared.outputs import FinishReason
from shared.sampling import SamplingParams

# --------------------------------------------------------------------------- rejection


def test_rejects_prompt_plus_max_tokens_beyond_max_model_len() -> None:
    h = Harness(max_model_len=32)
    error = rejected(h, "r", 10, max_tokens=30)
    assert error.code is ErrorCode.REJECTED
    assert "40" in error.message and "32" in error.message
    assert "r" not in h.sched.requests
    assert h.sched.finished_counts["rejected"] == 1


def test_rejects_a_prompt_that_fills_max_model_len() -> None:
    h = Harness(max_model_len=32)
    error = rejected(h, "r", 32, max_tokens=None)
    assert error.code is ErrorCode.REJECTED
    assert "32" in error.message


def test_rejects_a_request_needing_more_blocks_than_the_pool() -> None:
    h = Harness(num_gpu_blocks=4, max_model_len=64)
    error = rejected(h, "r", 10, max_tokens=10)  # 20 tokens = 5 blocks
    assert error.code is ErrorCode.REJECTED
    assert "5" in error.message and "4" in error.message
    h.add("ok", 10, max_tokens=6)  # 16 tokens = 4 blocks: fits exactly


def test_rejects_a_duplicate_id_and_keeps_the_original() -> None:
    h = Harness()
    first = h.add("r", 5, max_tokens=2)
    error = rejected(h, "r", 5, max_tokens=2)
    assert error.code is ErrorCode.DUPLICATE
    assert "'r'" in error.message
    assert h.sched.requests["r"] is first
    assert len(h.sched.waiting) == 1
    h.run()
    h.assert_reference_outputs()


def test_rejects_a_sample_id_clash() -> None:
    h = Harness()
    h.add("x/1", 5, max_tokens=2)
    error = rejected(h, "x", 5, max_tokens=2, n=2)
    assert error.code is ErrorCode.DUPLICATE
    assert "x/1" in error.message


@pytest.mark.parametrize("prompt", [[], [1, -2, 3]])
def test_rejects_bad_prompts(prompt: list[int]) -> None:
    h = Harness()
    error = rejected(h, "r", prompt)
    assert error.code is ErrorCode.BAD_REQUEST
    assert "prompt_token_ids" in error.message


def test_rejects_n_beyond_max_num_seqs() -> None:
    h = Harness(max_num_seqs=2)
    error = rejected(h, "r", 5, max_tokens=2, n=3)
    assert error.code is ErrorCode.BAD_REQUEST
    assert "n=3" in error.message and "max_num_seqs=2" in error.message
    h.add("ok", 5, max_tokens=2, n=2)


def test_rejects_when_the_waiting_queue_is_full() -> None:
    h = Harness(max_waiting_requests=2)
    h.add("a", 5, max_tokens=2)
    h.add("b", 5, max_tokens=2)
    error = rejected(h, "c", 5, max_tokens=2)
    assert error.code is ErrorCode.OVERLOADED
    assert "2" in error.message
    assert h.sched.finished_counts["rejected"] == 1
    h.step()  # both admitted: the queue has room again
    h.add("c", 5, max_tokens=2)
    h.run()
    h.assert_reference_outputs()


def test_rejects_a_non_integer_priority() -> None:
    h = Harness()
    with pytest.raises(RejectedError) as info:
        h.sched.add_request("r", [1, 2], SamplingParams(), priority=1.5)  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_rejects_a_non_string_client() -> None:
    h = Harness()
    with pytest.raises(RejectedError) as info:
        h.sched.add_request("r", [1, 2], SamplingParams(), client=7)  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert len(h.sched.fair_share) == 0


# --------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget() -> None:
    h = Harness(max_num_batched_tokens=32, max_model_len=128)
    request = h.add("r", 100, max_tokens=3)
    seq = request.seqs[0]
    chunks = []
    for expected_computed in (32, 64, 96):
        output = h.step()
        chunks.append(output.plan.num_scheduled_tokens["r"])
        assert h.result is not None and h.result.sampled_token_ids == {}
        assert output.tokens == []
        assert seq.num_computed_tokens == expected_computed
        assert seq.num_output_tokens == 0
    output = h.step()
    chunks.append(output.plan.num_scheduled_tokens["r"])
    assert chunks == [32, 32, 32, 4]
    assert h.result is not None and list(h.result.sampled_token_ids) == ["r"]
    assert output.tokens == [("r", 0, "r", seq.token_ids[-1])]
    assert seq.num_output_tokens == 1
    # The first chunk sends the sequence in full, later ones only grow its table.
    assert [n.seq_id for n in h.plans[0].new_seqs] == ["r"]
    assert all(p.new_seqs == [] for p in h.plans[1:])
    h.run()
    h.assert_reference_outputs()


def test_long_prefill_token_threshold_caps_a_chunk() -> None:
    h = Harness(max_num_batched_tokens=32, long_prefill_token_threshold=10)
    h.add("r", 25, max_tokens=2)
    h.add("s", 6, max_tokens=2)
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"r": 10, "s": 6}
    plan = h.step().plan
    assert plan.num_scheduled_tokens["r"] == 10
    plan = h.step().plan
    assert plan.num_scheduled_tokens["r"] == 5
    h.run()
    h.assert_reference_outputs()


def test_token_budget_is_shared_by_decodes_and_prefill_chunks() -> None:
    h = Harness(max_num_batched_tokens=16)
    for name in ("a", "b", "c"):
        h.add(name, 10, max_tokens=4)
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 10, "b": 6}
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    h.run()
    assert all(p.total_tokens <= 16 for p in h.plans)
    assert max(p.total_tokens for p in h.plans) == 16
    h.assert_reference_outputs()


def test_max_num_seqs_caps_the_running_set() -> None:
    h = Harness(max_num_seqs=2)
    for name in ("a", "b", "c", "d"):
        h.add(name, 5, max_tokens=3)
    plan = h.step().plan
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert len(h.sched.waiting) == 2
    h.run()
    assert all(len(p.num_scheduled_tokens) <= 2 for p in h.plans)
    h.assert_reference_outputs()


def test_max_num_seqs_counts_samples_still_to_fork() -> None:
    # "a" (n=3) is still in chunked prefill: its two unforked samples hold slots.
    h = Harness(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=8)
    h.add("a", 20, max_tokens=2, n=3)
    h.add("b", 4, max_tokens=2)
    h.add("c", 4, max_tokens=2)
    plan = h.step().plan
    assert set(plan.num_scheduled_tokens) == {"a/0", "b"}
    h.run()
    h.assert_reference_outputs()


# --------------------------------------------------------------------------- stopping


def test_eos_stops_the_request() -> None:
    h = Harness(eos_at={"r": 3})
    request = h.add("r", 6, max_tokens=10)
    h.run()
    seq = request.seqs[0]
    assert seq.num_output_tokens == 3
    assert seq.output_token_ids[-1] == h.model.eos_token_id
    assert request.finish_reason == FinishReason.STOP
    assert h.sched.finished_counts["stop"] == 1
    h.assert_reference_outputs()


def test_ignore_eos_runs_to_max_tokens() -> None:
    h = Harness(eos_at={"r": 3})
    request = h.add("r", 6, max_tokens=6, ignore_eos=True)
    h.run()
    seq = request.seqs[0]
    assert seq.num_output_tokens == 6
    assert seq.output_token_ids[2] == h.model.eos_token_id
    assert request.finish_reason == FinishReason.LENGTH
    h.assert_reference_outputs()


def test_min_tokens_suppresses_an_early_eos() -> None:
    h = Harness()
    eos = h.model.eos_token_id
    request = h.add("r", 6, max_tokens=8, min_tokens=2)
    seq = request.seqs[0]
    h.sched.schedule()
    h.sched.update(StepResult(step=0, sampled_token_ids={"r": [eos]}))
    assert seq.status is SeqStatus.RUNNING
    h.sched.schedule()
    h.sched.update(StepResult(step=1, sampled_token_ids={"r": [eos]}))
    assert seq.status is SeqStatus.RUNNING  # 2 outputs, min_tokens=2: still too early
    h.sched.schedule()
    output = h.sched.update(StepResult(step=2, sampled_token_ids={"r": [eos]}))
    assert seq.finish_reason == FinishReason.STOP
    assert output.finished_requests == [request.request_id]
    assert seq.output_token_ids == [eos, eos, eos]
    assert check_invariants(h.sched) == []


def test_stop_token_ids_stop_the_request() -> None:
    probe = Harness()
    probe_request = probe.add("r", 6, max_tokens=8)
    tokens, _ = probe.reference(probe_request)

    h = Harness()
    request = h.add("r", 6, max_tokens=8, stop_token_ids=[tokens[2]])
    h.run()
    assert request.seqs[0].output_token_ids == tokens[:3]
    assert request.finish_reason == FinishReason.STOP
    h.assert_reference_outputs()


def test_min_tokens_suppresses_an_early_stop_token() -> None:
    probe = Harness()
    tokens, _ = probe.reference(probe.add("r", 6, max_tokens=8))
    h = Harness()
    request = h.add("r", 6, max_tokens=8, min_tokens=3, stop_token_ids=[tokens[1]])
    h.run()
    output = request.seqs[0].output_token_ids
    assert len(output) > 2
    assert output[:2] == tokens[:2]
    h.assert_reference_outputs()


def test_max_tokens_ends_with_length() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=5)
    h.run()
    assert request.seqs[0].num_output_tokens == 5
    assert request.finish_reason == FinishReason.LENGTH
    assert h.sched.finished_counts["length"] == 1
    h.assert_reference_outputs()


def test_max_model_len_ends_with_length() -> None:
    h = Harness(max_model_len=16)
    request = h.add("r", 10, max_tokens=None)
    h.run()
    assert request.seqs[0].num_tokens == 16
    assert request.seqs[0].num_output_tokens == 6
    assert request.finish_reason == FinishReason.LENGTH
    h.assert_reference_outputs()


def test_finished_requests_free_their_blocks() -> None:
    h = Harness(num_gpu_blocks=16)
    h.add("a", 9, max_tokens=4)
    h.add("b", 7, max_tokens=3)
    h.run()
    assert h.sched.kv.pool.num_free == 16
    assert h.sched.requests == {}
    assert h.sched.seqs == {}
    assert h.worker.seqs == {}  # the worker was told to drop both


# --------------------------------------------------------------------------- abort


def test_abort_a_waiting_request() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=4)
    h.add("s", 6, max_tokens=2)
    assert h.sched.abort("r") is True
    assert h.sched.abort("r") is False
    assert request.finish_reason == FinishReason.ABORT
    assert request.seqs[0].status is SeqStatus.FINISHED
    assert len(h.sched.waiting) == 1
    assert h.sched.finished_counts["abort"] == 1
    h.check()
    plan = h.step().plan
    assert "r" not in plan.num_scheduled_tokens
    assert plan.freed_seq_ids == []  # never reached the worker
    del h.requests["r"]
    h.run()
    h.assert_reference_outputs()


def test_abort_a_running_request_frees_blocks_and_tells_the_worker() -> None:
    h = Harness(num_gpu_blocks=16)
    request = h.add("r", 10, max_tokens=8)
    h.step()
    h.step()
    assert h.sched.kv.pool.num_free == 13
    assert h.sched.abort("r") is True
    assert h.sched.abort("r") is False
    assert request.seqs[0].block_table == []
    assert h.sched.kv.pool.num_free == 16
    h.check()
    plan = h.sched.schedule()
    assert plan.freed_seq_ids == ["r"]
    assert plan.num_scheduled_tokens == {}
    h.sched.update(h.worker.execute(plan))
    assert "r" not in h.worker.seqs
    h.check()
    plan = h.sched.schedule()
    assert plan.freed_seq_ids == []  # told once


def test_abort_while_the_step_is_in_flight() -> None:
    h = Harness()
    h.add("r", 6, max_tokens=8)
    h.add("s", 6, max_tokens=3)
    h.step()
    plan = h.sched.schedule()
    assert "r" in plan.num_scheduled_tokens
    assert h.sched.abort("r") is True
    result = h.worker.execute(plan)
    output = h.sched.update(result)
    assert all(seq_id != "r" for _, _, seq_id, _ in output.tokens)
    h.check()
    assert h.requests["r"].seqs[0].num_output_tokens == 1
    plan = h.step().plan
    assert plan.freed_seq_ids == ["r"]
    del h.requests["r"]
    h.run()
    h.assert_reference_outputs()


def test_abort_a_swapped_request_releases_its_cpu_blocks() -> None:
    h = Harness(
        num_gpu_blocks=8, num_cpu_blocks=32, preemption_mode="swap", max_num_batched_tokens=64
    )
    h.add("a", 8, max_tokens=12)
    b = h.add("b", 8, max_tokens=12)
    for _ in range(40):
        h.step()
        if b.seqs[0].status is SeqStatus.SWAPPED:
            break
    seq = b.seqs[0]
    assert seq.status is SeqStatus.SWAPPED
    assert seq.cpu_block_table
    assert h.sched.abort("b") is True
    assert h.sched.abort("b") is False
    assert seq.cpu_block_table == []
    assert len(h.sched.swapped) == 0
    assert b.finish_reason == FinishReason.ABORT
    h.check()
    del h.requests["b"]
    h.run()
    assert h.sched.kv.cpu_pool.num_free == 32
    assert h.sched.kv.pool.num_free == 8
    h.assert_reference_outputs()


def test_abort_unknown_request_returns_false() -> None:
    assert Harness().sched.abort("nope") is False


# --------------------------------------------------------------------------- prefix sharing


def test_identical_prompts_admitted_together_share_blocks() -> None:
    h = Harness()
    prompt = h.model.prompt("p", 10)
    a = h.add("a", prompt, max_tokens=4)
    b = h.add("b", prompt, max_tokens=4)
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 10, "b": 2}
    assert h.last.prefix_hit_tokens == {"a": 0, "b": 8}
    a_table, b_table = a.seqs[0].block_table, b.seqs[0].block_table
    assert a_table[:2] == b_table[:2]
    assert a_table[2] != b_table[2]
    ref_cnt = h.sched.kv.pool.ref_cnt
    assert [ref_cnt[x] for x in a_table] == [2, 2, 1]
    assert ref_cnt[b_table[2]] == 1
    new_b = next(n for n in plan.new_seqs if n.seq_id == "b")
    assert new_b.num_computed_tokens == 8
    assert new_b.block_ids == b_table
    h.run()
    h.assert_reference_outputs()


@pytest.mark.parametrize("length", [10, 12, 13])
def test_a_later_identical_prompt_hits_the_prefix_cache(length: int) -> None:
    h = Harness()
    prompt = h.model.prompt("p", length)
    h.add("a", prompt, max_tokens=3)
    h.run()
    h.add("c", prompt, max_tokens=3)
    plan = h.step().plan
    expected = (length - 1) // BS * BS
    assert h.last.prefix_hit_tokens == {"c": expected}
    assert plan.num_scheduled_tokens == {"c": length - expected}
    assert h.sched.kv.hit_tokens == expected
    h.run()
    h.assert_reference_outputs()


def test_no_prefix_hits_with_prefix_caching_disabled() -> None:
    h = Harness(enable_prefix_caching=False)
    prompt = h.model.prompt("p", 10)
    a = h.add("a", prompt, max_tokens=3)
    b = h.add("b", prompt, max_tokens=3)
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"a": 10, "b": 10}
    assert h.last.prefix_hit_tokens == {"a": 0, "b": 0}
    assert not set(a.seqs[0].block_table) & set(b.seqs[0].block_table)
    h.run()
    h.assert_reference_outputs()


# --------------------------------------------------------------------------- n > 1


def test_parallel_samples_share_the_prompt_and_copy_on_write() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=5, n=3)
    output = h.step()
    plan = output.plan
    assert plan.num_scheduled_tokens == {"r/0": 6}
    assert plan.num_samples == {"r/0": 3}
    assert h.result is not None and len(h.result.sampled_token_ids["r/0"]) == 3
    assert [s.seq_id for s in request.seqs] == ["r/0", "r/1", "r/2"]
    assert [s.seq_id for s in h.sched.running] == ["r/0", "r/1", "r/2"]
    tables = [s.block_table for s in request.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert len(tables[0]) == 2
    ref_cnt = h.sched.kv.pool.ref_cnt
    assert [ref_cnt[b] for b in tables[0]] == [3, 3]
    assert {seq_id for _, _, seq_id, _ in output.tokens} == {"r/0", "r/1", "r/2"}

    shared_partial = tables[0][1]
    plan = h.step().plan
    assert plan.num_scheduled_tokens == {"r/0": 1, "r/1": 1, "r/2": 1}
    assert len(plan.copies) == 2
    assert all(src == shared_partial for src, _ in plan.copies)
    assert len({dst for _, dst in plan.copies}) == 2
    assert {n.seq_id for n in plan.new_seqs} == {"r/1", "r/2"}
    (update,) = plan.block_updates
    assert update.seq_id == "r/0"
    assert update.replaced == [(1, request.seqs[0].block_table[1])]
    assert request.seqs[2].block_table[1] == shared_partial  # the last writes in place
    assert ref_cnt[tables[0][0]] == 3
    h.run()
    h.assert_reference_outputs()


def test_parallel_samples_on_a_block_boundary_need_no_copies() -> None:
    h = Harness()
    h.add("r", 8, max_tokens=3, n=2)
    h.step()
    plan = h.step().plan
    assert plan.copies == []
    h.run()
    h.assert_reference_outputs()


def test_parallel_samples_with_a_chunked_prompt() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add("r", 18, max_tokens=4, n=2)
    plans = [h.step().plan for _ in range(3)]
    assert [p.num_samples for p in plans] == [{}, {}, {"r/0": 2}]
    h.run()
    h.assert_reference_outputs()


def test_abort_a_request_with_unforked_samples() -> None:
    h = Harness(max_num_batched_tokens=8)
    request = h.add("r", 18, max_tokens=4, n=3)
    h.step()
    assert h.sched.abort("r") is True
    assert request.finished
    assert request.num_unfinished == 0
    assert h.sched.requests == {}
    h.check()
    plan = h.step().plan
    assert plan.freed_seq_ids == ["r/0"]


# --------------------------------------------------------------------------- preemption


def preemption_harness(mode: str) -> tuple[Harness, Request, Request]:
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=32, preemption_mode=mode)
    a = h.add("a", 8, max_tokens=12)
    b = h.add("b", 8, max_tokens=12)
    return h, a, b


def test_forced_swap_swaps_out_and_back_in() -> None:
    h, _, b = preemption_harness("swap")
    preempted, swapped_in = [], []
    while h.sched.has_work():
        h.step()
        preempted += h.last.preempted
        swapped_in += h.last.swapped_in
    assert ("b", "swap") in preempted
    assert all(mode == "swap" for _, mode in preempted)
    assert "b" in swapped_in
    assert b.seqs[0].num_preemptions >= 1
    assert h.sched.preemptions["swap"] >= 1
    assert h.sched.preemptions["recompute"] == 0
    assert h.worker.swapped_blocks > 0
    assert any(p.swap_out for p in h.plans)
    assert any(p.swap_in for p in h.plans)
    assert h.sched.kv.cpu_pool.num_free == 32
    h.assert_reference_outputs()


def test_swap_out_plan_copies_the_victims_blocks() -> None:
    h, _, b = preemption_harness("swap")
    while True:
        table = list(b.seqs[0].block_table)
        plan = h.step().plan
        if h.last.preempted:
            break
    assert h.last.preempted == [("b", "swap")]
    assert [device for device, _ in plan.swap_out] == table
    assert [cpu for _, cpu in plan.swap_out] == b.seqs[0].cpu_block_table
    assert "b" in plan.freed_seq_ids
    assert "b" not in plan.num_scheduled_tokens
    assert b.seqs[0].status is SeqStatus.SWAPPED
    assert b.seqs[0].block_table == []


def test_forced_recompute_drops_and_rebuilds() -> None:
    h, _, b = preemption_harness("recompute")
    preempted = []
    while h.sched.has_work():
        h.step()
        preempted += h.last.preempted
        assert h.last.swapped_in == []
    assert ("b", "recompute") in preempted
    assert h.sched.preemptions["swap"] == 0
    assert h.worker.swapped_blocks == 0
    assert all(not p.swap_out and not p.swap_in for p in h.plans)
    assert b.seqs[0].num_preemptions >= 1
    h.assert_reference_outputs()


def test_swap_mode_falls_back_to_recompute_without_a_cpu_pool() -> None:
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=0, preemption_mode="swap")
    h.add("a", 8, max_tokens=12)
    h.add("b", 8, max_tokens=12)
    preempted = []
    while h.sched.has_work():
        h.step()
        preempted += h.last.preempted
    assert preempted
    assert all(mode == "recompute" for _, mode in preempted)
    h.assert_reference_outputs()


def test_swapped_parallel_samples_end_correctly() -> None:
    h = Harness(num_gpu_blocks=10, num_cpu_blocks=32, preemption_mode="swap")
    h.add("a", 6, max_tokens=14, n=2)
    h.add("b", 6, max_tokens=10)
    preempted = []
    while h.sched.has_work():
        h.step()
        preempted += h.last.preempted
    assert preempted
    h.assert_reference_outputs()


# --------------------------------------------------------------------------- priority


def test_high_priority_arrival_preempts_a_running_low_priority_request() -> None:
    h = Harness(num_gpu_blocks=6, policy="priority")
    low = h.add("low", 20, max_tokens=4, priority=10)
    h.step()
    assert low.seqs[0].status is SeqStatus.RUNNING
    assert h.sched.kv.pool.num_free == 1
    high = h.add("high", 8, max_tokens=4, priority=0)
    plan = h.step().plan
    assert h.last.preempted == [("low", "recompute")]
    assert "high" in plan.num_scheduled_tokens
    assert "low" not in plan.num_scheduled_tokens
    assert "low" in plan.freed_seq_ids
    assert low.seqs[0].status is SeqStatus.WAITING
    assert high.seqs[0].status is SeqStatus.RUNNING
    h.run()
    h.assert_reference_outputs()
    # The high-priority request finished first.
    assert high.seqs[0].num_output_tokens == 4


def test_fcfs_does_not_preempt_for_a_new_arrival() -> None:
    h = Harness(num_gpu_blocks=6, policy="fcfs")
    h.add("low", 20, max_tokens=4, priority=10)
    h.step()
    h.add("high", 8, max_tokens=4, priority=0)
    plan = h.step().plan
    assert h.last.preempted == []
    assert plan.num_scheduled_tokens == {"low": 1}
    h.run()
    h.assert_reference_outputs()


def test_priority_does_not_preempt_a_better_ranked_request() -> None:
    h = Harness(num_gpu_blocks=6, policy="priority")
    h.add("high", 20, max_tokens=4, priority=0)
    h.step()
    h.add("low", 8, max_tokens=4, priority=10)
    plan = h.step().plan
    assert h.last.preempted == []
    assert plan.num_scheduled_tokens == {"high": 1}
    h.run()
    h.assert_reference_outputs()


def test_snapshot_reflects_the_state() -> None:
    h = Harness(num_gpu_blocks=16)
    h.add("a", 10, max_tokens=4)
    h.add("b", 6, max_tokens=4, priority=3)
    h.step()
    snap = snapshot(h.sched)
    assert snap.step == 1
    assert snap.num_running == 2
    assert snap.num_waiting == 0
    assert snap.gpu_blocks.total == 16
    assert snap.gpu_blocks.free == 16 - 3 - 2
    assert {s.seq_id: s.state for s in snap.seqs} == {"a": "running", "b": "running"}
    assert {s.seq_id: s.num_output_tokens for s in snap.seqs} == {"a": 1, "b": 1}


# --------------------------------------------------------------------------- more n > 1


def test_parallel_samples_ending_on_their_first_token() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=1, n=3)
    output = h.step()
    assert request.finished
    assert output.finished_requests == ["r"]
    assert {(rid, index) for rid, index, _ in output.finished_seqs} == {
        ("r", 0),
        ("r", 1),
        ("r", 2),
    }
    assert h.sched.kv.pool.num_free == h.cfg.num_gpu_blocks
    assert h.sched.running == []
    h.run()
    assert h.worker.seqs == {}
    h.assert_reference_outputs()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_samples_that_cannot_all_fit_still_finish(mode: str) -> None:
    # Each sample alone needs 6 blocks (24 tokens); three together need 14.
    h = Harness(num_gpu_blocks=7, num_cpu_blocks=32, preemption_mode=mode)
    h.add("r", 8, max_tokens=16, n=3)
    preempted = []
    while h.sched.has_work():
        h.step()
        preempted += h.last.preempted
    assert preempted
    h.assert_reference_outputs()


def test_finish_seq_ends_one_sample() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=6, n=2)
    h.step()
    h.step()
    assert h.sched.finish_seq("r/1") is True
    assert h.sched.finish_seq("r/1") is False
    assert request.seqs[1].finish_reason == FinishReason.STOP
    assert not request.finished
    h.check()
    plan = h.step().plan
    assert plan.freed_seq_ids == ["r/1"]
    assert list(plan.num_scheduled_tokens) == ["r/0"]
    h.run()
    assert request.finished
    assert request.seqs[0].num_output_tokens == 6
    assert request.seqs[1].num_output_tokens == 2


# --------------------------------------------------------------------------- protocol


def test_schedule_twice_without_update_raises() -> None:
    h = Harness()
    h.add("r", 6, max_tokens=2)
    h.sched.schedule()
    with pytest.raises(RuntimeError, match=r"^schedule\(\) called with too many steps in flight$"):
        h.sched.schedule()


def test_update_without_a_step_raises() -> None:
    h = Harness()
    with pytest.raises(RuntimeError, match=r"^update\(\) without a scheduled step$"):
        h.sched.update(StepResult(step=0, sampled_token_ids={}))


def test_update_rejects_a_result_for_another_step() -> None:
    h = Harness()
    h.add("r", 6, max_tokens=2)
    plan = h.sched.schedule()
    result = h.worker.execute(plan)
    with pytest.raises(WorkerProtocolError, match=r"^result for step 5, expected 0$"):
        h.sched.update(StepResult(step=5, sampled_token_ids=result.sampled_token_ids))


@pytest.mark.parametrize("tokens", [None, [], [7, 8]])
def test_update_rejects_a_wrong_number_of_samples(tokens: list[int] | None) -> None:
    h = Harness()
    h.add("r", 6, max_tokens=2)
    h.sched.schedule()
    sampled = {} if tokens is None else {"r": tokens}
    with pytest.raises(WorkerProtocolError, match=r"^r: expected 1 sampled tokens, got "):
        h.sched.update(StepResult(step=0, sampled_token_ids=sampled))


# --------------------------------------------------------------------------- worker loss


def test_worker_lost_between_steps_requeues_for_recompute() -> None:
    h = Harness()
    h.add("a", 10, max_tokens=6)
    h.add("b", 10, max_tokens=6)
    h.step()
    h.step()
    h.sched.on_worker_lost()
    restart_worker(h)
    assert h.sched.running == []
    assert len(h.sched.waiting) == 2
    assert all(s.num_computed_tokens == 0 for s in h.sched.waiting)
    assert h.sched.kv.pool.num_free == h.cfg.num_gpu_blocks
    assert h.sched.kv.pool.cached == {}
    h.check()
    plan = h.step().plan
    assert plan.freed_seq_ids == []
    assert {n.seq_id for n in plan.new_seqs} == {"a", "b"}
    h.run()
    h.assert_reference_outputs()


def test_worker_lost_with_a_step_in_flight() -> None:
    h = Harness()
    h.add("a", 10, max_tokens=6)
    h.step()
    h.sched.schedule()  # the worker dies before answering
    h.sched.on_worker_lost()
    restart_worker(h)
    h.check()
    h.run()
    h.assert_reference_outputs()


def test_worker_lost_while_its_swap_out_was_in_flight() -> None:
    # The step that swaps "b" out never ran: its CPU blocks were never written, so
    # "b" must not be resumed from them.
    h, _, b = preemption_harness("swap")
    while True:
        plan = h.sched.schedule()
        if plan.swap_out:
            break
        h.sched.update(h.worker.execute(plan))
        h.check()
    assert b.seqs[0].status is SeqStatus.SWAPPED
    h.sched.on_worker_lost()  # the plan above was never executed
    restart_worker(h)
    h.check()
    h.run()
    h.assert_reference_outputs()


def test_a_request_in_two_failed_steps_is_quarantined_the_others_go_on() -> None:
    h = Harness()
    h.add("a", 10, max_tokens=20)
    h.step()
    h.sched.schedule()  # "a" is in the step a worker dies in
    assert h.sched.on_worker_lost() == []  # first failure: re-queued
    restart_worker(h)
    assert h.requests["a"].num_failed_steps == 1
    h.step()
    h.add("b", 10, max_tokens=6)  # came after the first failure
    h.sched.schedule()
    quarantined = h.sched.on_worker_lost()
    restart_worker(h)
    assert quarantined == [h.requests["a"]]
    assert h.requests["a"].finish_reason is FinishReason.ABORT
    assert "a" not in h.sched.requests
    assert h.requests["b"].num_failed_steps == 1
    h.check()
    h.run()
    assert h.requests["b"].finish_reason is FinishReason.LENGTH
    assert h.sched.kv.pool.num_free == h.cfg.num_gpu_blocks


def test_a_worker_lost_between_steps_counts_against_nobody() -> None:
    h = Harness()
    h.add("a", 10, max_tokens=6)
    h.step()
    for _ in range(3):
        assert h.sched.on_worker_lost() == []
        restart_worker(h)
    assert h.requests["a"].num_failed_steps == 0
    h.run()
    h.assert_reference_outputs()


def test_prompt_token_ids_outside_the_vocabulary_are_refused() -> None:
    cfg = SchedulerConfig(block_size=BS, num_gpu_blocks=16, max_model_len=64)
    sched = Scheduler(cfg, eos_token_ids=[2], kv_bytes_per_block=1, vocab_size=100)
    sched.add_request("ok", [1, 99], SamplingParams(max_tokens=2))
    for token in (100, 10**9, 2**64 - 1):
        with pytest.raises(RejectedError, match=rf"token id {token} \(position 2\)") as refused:
            sched.add_request(f"bad-{token}", [1, 5, token], SamplingParams(max_tokens=2))
        assert refused.value.code is ErrorCode.BAD_REQUEST
        assert "vocabulary [0, 100)" in refused.value.message
    assert list(sched.requests) == ["ok"]


# --------------------------------------------------------------------------- fair share

HEAVY_REQUESTS = 100
HEAVY_TOKENS = 50


def light_client_waits(fair_share: bool) -> list[int]:
    """A heavy client queues 100 long requests (4 run at a time), then a light client
    sends 3 short ones; the steps from their submission to their end."""
    h = Harness(max_num_seqs=4, fair_share=fair_share)
    for index in range(HEAVY_REQUESTS):
        h.add(f"h{index}", 4, client="heavy", max_tokens=HEAVY_TOKENS, ignore_eos=True)
    for _ in range(3):
        h.step()
    submitted = h.sched.step
    light = [h.add(f"l{i}", 4, client="light", max_tokens=2, ignore_eos=True) for i in range(3)]
    waits: dict[str, int] = {}
    while len(waits) < len(light):
        for request_id in h.step().finished_requests:
            if h.requests[request_id].client == "light":
                waits[request_id] = h.sched.step - submitted
    for request in light:
        assert request.finish_reason == FinishReason.LENGTH
    return [waits[r.request_id] for r in light]


def test_fair_share_admits_a_light_client_at_the_next_free_slots() -> None:
    # The running heavy requests end within 50 steps; the light ones take the next
    # slots, whatever the size of the heavy backlog.
    waits = light_client_waits(fair_share=True)
    assert max(waits) <= 3 * HEAVY_TOKENS


def test_without_fair_share_a_light_client_waits_behind_the_heavy_backlog() -> None:
    waits = light_client_waits(fair_share=False)
    # 96 heavy requests were queued ahead of them, 4 at a time, 50 steps each.
    assert min(waits) >= (HEAVY_REQUESTS - 4) // 4 * HEAVY_TOKENS


def test_fair_share_interleaves_clients_at_admission() -> None:
    h = Harness(max_num_seqs=1)
    for index in range(3):
        h.add(f"a{index}", 4, client="a", max_tokens=1)
    for index in range(2):
        h.add(f"b{index}", 4, client="b", max_tokens=1)
    admitted: list[str] = []
    while h.sched.has_work():
        plan = h.step().plan
        admitted += [seq.seq_id for seq in plan.new_seqs]
    assert admitted == ["a0", "b0", "a1", "b1", "a2"]
    h.assert_reference_outputs()


def test_fair_share_state_is_dropped_when_a_client_has_nothing_unfinished() -> None:
    h = Harness(max_num_seqs=2)
    h.add("a0", 4, client="a", max_tokens=3)
    h.add("a1", 4, client="a", max_tokens=3)
    h.add("b0", 4, client="b", max_tokens=3, n=2)
    h.add("c0", 4, client="c", max_tokens=3)
    rejected(h, "c0", 4, max_tokens=3)  # a duplicate id: no state of its own
    assert len(h.sched.fair_share) == 3
    h.sched.abort("c0")
    assert len(h.sched.fair_share) == 2
    h.run()
    assert len(h.sched.fair_share) == 0
    del h.requests["c0"]
    h.assert_reference_outputs()
    # A client back after the others were served starts at the current round.
    h.add("a2", 4, client="a", max_tokens=1)
    h.step()
    h.add("a3", 4, client="a", max_tokens=1)
    again = h.add("c1", 4, client="c", max_tokens=1)
    assert again.fair_round == h.sched.fair_share.virtual_round(0.0)
    h.run()
    assert len(h.sched.fair_share) == 0


def test_fair_share_does_not_preempt_a_running_request_of_equal_priority() -> None:
    # Under the priority policy a new arrival may preempt running requests ranked
    # after it; a light client's request at the same priority never ranks ahead of a
    # running one, so it waits for a free slot instead of preempting.
    h = Harness(max_num_seqs=2, policy="priority", aging_rate=0.0)
    for index in range(6):
        h.add(f"h{index}", 8, client="heavy", max_tokens=8)
    h.step()
    assert len(h.sched.running) == 2  # every slot is taken
    light = h.add("l0", 4, client="light", max_tokens=2)
    plan = h.step().plan
    assert h.last.preempted == []
    assert "l0" not in plan.num_scheduled_tokens
    queued = [seq.seq_id for seq in h.sched.waiting]
    assert queued[0] == "l0"  # but it is first in line, ahead of the heavy backlog
    h.run()
    assert light.finished
    assert sum(h.sched.preemptions.values()) == 0
    h.assert_reference_outputs()
