"""The worker half of the plan protocol (ipc/plan_state.py): strict state updates, the
batch a plan yields, and the resend after a lost worker."""

from __future__ import annotations

import copy

import msgspec
import pytest

from ipc.plan_state import WorkerState, WorkerStateError
from ipc.schema import NO_TOKEN, BatchPlan, BlockUpdate, NewSeq
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.fake_worker import FakeModel, FakeWorker
from scheduler_svc.step_engine import InlineExecutor, StepEngine
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams

BS = 4


def new_seq(
    seq_id: str, num_tokens: int = 6, *, computed: int = 0, prompt: int | None = None
) -> NewSeq:
    return NewSeq(
        seq_id=seq_id,
        request_id=seq_id,
        sample_index=0,
        token_ids=list(range(10, 10 + num_tokens)),
        num_prompt_tokens=num_tokens if prompt is None else prompt,
        num_computed_tokens=computed,
        block_ids=list(range(-(-num_tokens // BS))),
        sampling=SamplingParams(),
    )


def plan(step: int = 0, scheduled: dict[str, int] | None = None, **fields: object) -> BatchPlan:
    return BatchPlan(step=step, num_scheduled_tokens=scheduled or {}, **fields)  # type: ignore[arg-type]


def holding(*seqs: NewSeq) -> WorkerState:
    state = WorkerState(4)
    state.apply(plan(new_seqs=list(seqs)))
    return state


# --------------------------------------------------------------------------- violations


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (plan(freed_seq_ids=["x"]), "frees unknown"),
        (plan(new_seqs=[new_seq("a")]), "again as new"),
        (plan(block_updates=[BlockUpdate(seq_id="x", appended=[7])]), "unknown"),
        (plan(block_updates=[BlockUpdate(seq_id="a", replaced=[(2, 7)])]), "block 2"),
        (plan(scheduled={"x": 1}), "unknown"),
        (plan(scheduled={"a": 7}), "7 tokens scheduled at 0 of 6"),
        (plan(scheduled={"a": 0}), "0 tokens"),
        (plan(scheduled={"a": 6}, num_samples={"x": 2}), "unscheduled"),
        (plan(scheduled={"a": 4}, num_samples={"a": 2}), "2 samples asked at 4 of 6"),
        (plan(scheduled={"a": 6}, num_samples={"a": 0}), "0 samples"),
    ],
    ids=[
        "unknown-freed",
        "known-new",
        "unknown-update",
        "replace-out-of-table",
        "unknown-scheduled",
        "beyond-known-tokens",
        "zero-tokens",
        "samples-unscheduled",
        "samples-before-end",
        "zero-samples",
    ],
)
def test_every_protocol_violation_raises(bad: BatchPlan, match: str) -> None:
    state = holding(new_seq("a"))
    with pytest.raises(WorkerStateError, match=match):
        state.apply(bad)


def test_a_freed_sequence_is_unknown_afterwards() -> None:
    state = holding(new_seq("a"))
    state.apply(plan(freed_seq_ids=["a"]))
    assert state.seqs == {}
    with pytest.raises(WorkerStateError, match="frees unknown"):
        state.apply(plan(freed_seq_ids=["a"]))


def test_free_then_resend_in_one_plan_is_legal() -> None:
    # Preempted by recompute, then re-admitted: the free comes before the NewSeq.
    state = holding(new_seq("a"))
    state.apply(plan(scheduled={"a": 6}))
    state.append_sampled({"a": [99]})
    state.apply(plan(freed_seq_ids=["a"], new_seqs=[new_seq("a")]))
    assert state.seqs["a"].token_ids == list(range(10, 16))
    assert state.seqs["a"].num_computed_tokens == 0


def test_a_token_sampled_where_none_is_due_raises() -> None:
    state = holding(new_seq("a"))
    state.apply(plan(scheduled={"a": 4}))
    with pytest.raises(WorkerStateError, match="none was due"):
        state.append_sampled({"a": [99]})
    with pytest.raises(WorkerStateError, match="unknown"):
        state.append_sampled({"x": [99]})


def test_no_token_is_kept_as_a_token_the_model_can_read() -> None:
    """A step planned before the scheduler learnt of a NO_TOKEN (overlap) computes that
    position: the worker's copy holds 0 there, never -1 (an embedding index)."""
    state = holding(new_seq("a"))
    state.apply(plan(scheduled={"a": 6}))
    state.append_sampled({"a": [NO_TOKEN]})
    [item] = state.apply(plan(1, {"a": 1}))
    assert state.seqs["a"].token_ids[-1] == 0 and item.positions == range(6, 7)


# --------------------------------------------------------------------------- the batch


def test_chunked_prefill_samples_nothing_until_the_end() -> None:
    state = holding(new_seq("a", 10))
    counts = []
    for step, chunk in enumerate([4, 4, 2]):
        [item] = state.apply(plan(step, {"a": chunk}))
        assert item.positions == range(4 * step, 4 * step + chunk)
        assert item.end == state.seqs["a"].num_computed_tokens
        counts.append((item.num_samples, item.sample_indices))
    assert counts == [(0, []), (0, []), (1, [0])]
    state.append_sampled({"a": [99]})
    [decode] = state.apply(plan(3, {"a": 1}))
    assert (decode.start, decode.num_tokens, decode.num_samples) == (10, 1, 1)


def test_the_fork_step_samples_n_and_keeps_the_first() -> None:
    state = holding(new_seq("r/0", 5))
    [item] = state.apply(plan(scheduled={"r/0": 5}, num_samples={"r/0": 3}))
    assert item.num_samples == 3
    assert item.sample_indices == [0, 1, 2]
    state.append_sampled({"r/0": [7, 8, 9]})
    assert state.seqs["r/0"].token_ids[-1] == 7
    assert state.seqs["r/0"].num_output_tokens == 1


def test_batch_order_block_updates_and_a_prefix_hit() -> None:
    state = holding(new_seq("a", 4), new_seq("b", 8, computed=4))
    batch = state.apply(
        plan(
            scheduled={"b": 4, "a": 4},
            block_updates=[BlockUpdate(seq_id="a", appended=[5], replaced=[(0, 9)])],
        )
    )
    assert [item.seq.seq_id for item in batch] == ["b", "a"]
    assert batch[0].positions == range(4, 8)
    assert state.seqs["a"].block_ids == [9, 5]


# --------------------------------------------------------------------------- reset


def test_reset_forgets_everything_before_the_resend() -> None:
    state = holding(new_seq("a"), new_seq("b"))
    state.apply(plan(scheduled={"a": 6}))
    state.append_sampled({"a": [99]})
    [item] = state.apply(plan(reset=True, new_seqs=[new_seq("a", 7)], scheduled={"a": 7}))
    assert set(state.seqs) == {"a"}
    assert item.start == 0 and item.num_samples == 1
    with pytest.raises(WorkerStateError, match="frees unknown"):
        state.apply(plan(freed_seq_ids=["b"]))


def test_reset_on_a_fresh_worker_is_harmless() -> None:
    state = WorkerState(4)
    state.apply(plan(reset=True, new_seqs=[new_seq("a")], scheduled={"a": 6}))
    assert set(state.seqs) == {"a"}


@pytest.mark.parametrize("survivor_ran_the_lost_step", [False, True])
def test_a_surviving_worker_gets_a_reset_plan_after_another_is_lost(
    survivor_ran_the_lost_step: bool,
) -> None:
    """Two ranks, one lost: the scheduler resends everything as NewSeq; the survivor
    still holds those ids (and, if it ran the discarded step, is ahead), so only the
    plan's reset makes the resend legal."""
    cfg = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=32,
        max_num_batched_tokens=16,
        max_model_len=64,
        watermark=0.0,
        overlap_scheduling=False,
    )
    model = FakeModel()
    sched = Scheduler(cfg, eos_token_ids=[model.eos_token_id], kv_bytes_per_block=1)
    survivor = FakeWorker(model, block_size=BS, num_gpu_blocks=32, num_cpu_blocks=0)
    for rid in ("a", "b"):
        sched.add_request(rid, model.prompt(rid, 10), SamplingParams(max_tokens=8, temperature=0))
    for _ in range(3):
        sched.update(survivor.execute(sched.schedule()))
    if survivor_ran_the_lost_step:
        survivor.execute(sched.schedule())  # the other rank died in this step
    assert sched.on_worker_lost() == []

    resend = sched.schedule()
    assert resend.reset
    assert {n.seq_id for n in resend.new_seqs} == {"a", "b"} == set(survivor.seqs)
    with pytest.raises(WorkerStateError, match="again as new"):
        copy.deepcopy(survivor.state).apply(msgspec.structs.replace(resend, reset=False))
    sched.update(survivor.execute(resend))
    assert not sched.schedule().reset  # once only


def test_the_survivor_finishes_every_request_exactly() -> None:
    cfg = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=32,
        max_num_batched_tokens=16,
        max_model_len=64,
        overlap_scheduling=False,  # the core is called directly between engine steps
    )
    model = FakeModel()
    sched = Scheduler(cfg, eos_token_ids=[model.eos_token_id], kv_bytes_per_block=1)
    survivor = FakeWorker(model, block_size=BS, num_gpu_blocks=32, num_cpu_blocks=0)
    params = SamplingParams(max_tokens=8, temperature=0, n=2)
    request = sched.add_request("r", model.prompt("r", 10), params)
    engine = StepEngine(sched, InlineExecutor(survivor.execute), check_invariants=True)
    for _ in range(4):
        engine.step()
    survivor.execute(sched.schedule())  # run by the survivor, lost elsewhere
    sched.on_worker_lost()
    while engine.has_work():
        engine.step()
    assert survivor.seqs == {}
    for seq in request.seqs:
        want, reason = model.reference_output("r", seq.sample_index, 10, params, 64)
        assert (seq.output_token_ids, seq.finish_reason) == (want, reason)


def drafting_state() -> tuple[WorkerState, BatchPlan]:
    """A worker holding one decoding sequence, and a plan that drafts 2 tokens for it."""
    state = holding(new_seq("a", 3))
    state.apply(plan(scheduled={"a": 3}))
    state.append_sampled({"a": [4]})
    drafts = plan(
        1,
        {"a": 3},
        block_updates=[BlockUpdate(seq_id="a", appended=[1])],
        draft_lengths={"a": 2},
    )
    return state, drafts


class Fixed:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.asked: list[tuple[list[int], list[int], int]] = []

    def draft(self, seqs):
        self.asked = [(list(s.token_ids), list(s.block_ids), k) for s, k in seqs]
        return {s.seq_id: self.tokens for s, _ in seqs}


def test_drafted_proposals_are_asked_after_the_block_updates_and_then_verified() -> None:
    state, plan = drafting_state()
    drafter = Fixed([5, 9])
    batch = state.apply(plan, drafter)
    assert drafter.asked == [([10, 11, 12, 4], [0, 1], 2)]  # the lookahead block is there
    assert state.proposals == {"a": [5, 9]}
    assert [(b.start, b.num_tokens, b.num_proposed) for b in batch] == [(3, 3, 2)]
    state.append_sampled({"a": [5, 6]}, state.proposals)  # 5 accepted, then 6
    held = state.seqs["a"]
    assert held.token_ids == [10, 11, 12, 4, 5, 6]
    assert held.num_computed_tokens == 5 and held.block_ids == [0, 1]


@pytest.mark.parametrize(
    ("drafter", "match"),
    [(None, "no drafter"), (Fixed([5]), "did not draft 2 tokens")],
    ids=["no-drafter", "short-draft"],
)
def test_a_draft_the_worker_cannot_make_is_a_protocol_error(drafter, match: str) -> None:
    state, plan = drafting_state()
    with pytest.raises(WorkerStateError, match=match):
        state.apply(plan, drafter)


def test_a_sequence_cannot_both_propose_and_draft() -> None:
    state, plan = drafting_state()
    both = msgspec.structs.replace(plan, proposals={"a": [5, 9]})
    with pytest.raises(WorkerStateError, match="both a proposal and a draft"):
        state.apply(both, Fixed([5, 9]))
