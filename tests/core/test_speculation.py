"""Speculative decoding in the core: proposals scheduled with their lookahead, results
applied over the accepted run, rejected slots given back, and the back-off.

The fake worker verifies proposals as the model runner does (the model's token at
each position while it equals the proposal, then the first that does not), and checks
every K/V slot attention reads; the fake proposer proposes the model's own tokens with
a set probability. Outputs must equal the same run without speculation.
"""

from __future__ import annotations

import msgspec
import pytest
from support.harness import (
    BS,
    Harness,
    checked_run,
    mixed_trace,
    restart_worker,
    trace_config,
)

from ipc.schema import SeqStatus, StepResult
from scheduler_svc.core.introspection import check_invariants
from scheduler_svc.core.speculation import (
    MAX_PROBE_INTERVAL,
    MIN_VERIFIED,
    PROBE_INTERVAL,
    SpeculationPolicy,
)
from scheduler_svc.core.step_records import WorkerProtocolError
from scheduler_svc.fake_worker import FakeProposer
from shared.config import SchedulerConfig
from shared.outputs import FinishReason


def speculating(acceptance: float, eos_at: dict[str, int] | None = None, **config: object):
    h = Harness(eos_at, num_speculative_tokens=4, **config)
    h.sched.proposer = FakeProposer(h.model, acceptance)
    return h


TRACE = mixed_trace(seed=3, longest=40)


def simulate(
    config: SchedulerConfig, *, overlap: bool, acceptance: float | None, drafted: bool = False
):
    options = {"overlap": overlap, "proposal_acceptance": acceptance, "drafted": drafted}
    return checked_run(TRACE, config, **options)[1]


@pytest.mark.parametrize(
    ("overlap", "mode"), [(False, "swap"), (True, "recompute")], ids=["step-exact", "overlap"]
)
@pytest.mark.parametrize("acceptance", [0.0, 0.8, 1.0])
@pytest.mark.parametrize("drafted", [False, True], ids=["proposed", "drafted"])
def test_a_trace_with_proposals_keeps_every_invariant_and_every_output(
    acceptance: float, overlap: bool, mode: str, drafted: bool
) -> None:
    """Chunked prefill, prefix hits, preemption (a small pool), n=3, aborts and EOS;
    every invariant after every plan and update, every K/V slot read checked; the
    proposals made by the scheduler, or drafted by the worker (a draft model's way)."""
    plain = simulate(trace_config(preemption_mode=mode), overlap=overlap, acceptance=None)
    spec = simulate(
        trace_config(preemption_mode=mode, num_speculative_tokens=4),
        overlap=overlap,
        acceptance=acceptance,
        drafted=drafted,
    )
    aborted = {req.id for req in TRACE if req.abort_step is not None}
    assert {rid: out for rid, out in spec.outputs.items() if rid not in aborted} == {
        rid: out for rid, out in plain.outputs.items() if rid not in aborted
    }
    assert spec.summary["leftover_blocks"] == {"gpu_in_use": 0, "cpu_in_use": 0}
    assert spec.summary["preemptions"][mode] > 0  # the pool is tight
    counts = spec.summary["speculation"]
    assert counts["proposals"] > (50 if acceptance else 0)  # none accepted: probes only
    if acceptance == 1.0:
        assert counts["accepted_tokens"] > 0.9 * counts["proposed_tokens"]
        assert spec.summary["steps"] < 0.7 * plain.summary["steps"]
    if acceptance == 0.0:
        assert counts["accepted_tokens"] == 0


def test_a_proposal_is_scheduled_after_the_last_token_with_its_lookahead() -> None:
    h = speculating(1.0)
    request = h.add("r", 6, max_tokens=20)
    seq = request.seqs[0]
    h.step()  # the prompt, and its first token
    plan = h.sched.schedule()
    assert plan is not None
    assert plan.proposals == {"r": h.sched.proposer.propose(seq, 4)}
    assert plan.num_scheduled_tokens == {"r": 5}
    assert seq.num_computed_tokens == 7 + 4  # every position of the chunk
    assert len(seq.block_table) == -(-11 // BS)
    outcome = h.sched.update(h.worker.execute(plan))
    assert check_invariants(h.sched) == []
    assert [token for _, _, _, token in outcome.tokens] == seq.output_token_ids[1:]
    assert seq.num_output_tokens == 1 + 5  # four accepted and the one after them
    assert seq.num_computed_tokens == seq.num_tokens - 1


def drafting(acceptance: float, **config: object) -> Harness:
    """The fake worker drafts (as a draft model does): the plans carry lengths only."""
    h = Harness(num_speculative_tokens=4, **config)
    h.sched.drafting = True
    h.worker.drafter = FakeProposer(h.model, acceptance)
    return h


def test_a_drafted_proposal_is_planned_by_length_and_verified_on_the_worker() -> None:
    h = drafting(1.0)
    request = h.add("r", 6, max_tokens=20)
    seq = request.seqs[0]
    h.step()
    plan = h.sched.schedule()
    assert plan is not None
    assert plan.proposals == {} and plan.draft_lengths == {"r": 4}
    assert plan.num_scheduled_tokens == {"r": 5}
    assert len(seq.block_table) == -(-11 // BS)  # the lookahead, as for a proposal
    h.sched.update(h.worker.execute(plan))
    assert seq.num_output_tokens == 1 + 5
    assert h.sched.speculation.num_accepted_tokens == 4
    assert check_invariants(h.sched) == []
    h.run()
    assert seq.output_token_ids == h.reference(request)[0]
    assert h.sched.kv.pool.num_free == h.cfg.num_gpu_blocks


def test_drafted_rejections_give_blocks_back_and_a_long_answer_is_an_error() -> None:
    h = drafting(0.0)
    request = h.add("r", 7, max_tokens=20)
    seq = request.seqs[0]
    h.step()
    free = h.sched.kv.pool.num_free
    plan = h.sched.schedule()
    assert plan is not None and plan.draft_lengths == {"r": 4}
    h.sched.update(h.worker.execute(plan))
    assert seq.num_output_tokens == 2 and len(seq.block_table) == 2
    assert h.sched.kv.pool.num_free == free
    assert h.worker.seqs["r"].block_ids == seq.block_table
    plan = h.sched.schedule()
    assert plan is not None and plan.draft_lengths == {"r": 4}
    with pytest.raises(WorkerProtocolError, match="do not answer the proposal 4"):
        h.sched.update(StepResult(step=plan.step, sampled_token_ids={"r": [5] * 6}))
    assert request.seqs[0].output_token_ids[:2] == h.reference(request)[0][:2]


def test_rejected_proposals_give_their_blocks_back() -> None:
    h = speculating(0.0)
    request = h.add("r", 7, max_tokens=20)
    seq = request.seqs[0]
    h.step()  # 8 tokens: two full blocks
    free = h.sched.kv.pool.num_free
    plan = h.sched.schedule()
    assert plan is not None and len(plan.proposals["r"]) == 4
    assert h.sched.kv.pool.num_free == free - 1  # the lookahead opened a third block
    h.sched.update(h.worker.execute(plan))
    assert seq.num_output_tokens == 2  # nothing accepted: the model's own token
    assert seq.num_computed_tokens == 8
    assert len(seq.block_table) == 2 and h.sched.kv.pool.num_free == free
    assert h.worker.seqs["r"].block_ids == seq.block_table
    assert check_invariants(h.sched) == []
    h.run()
    assert seq.output_token_ids == h.reference(request)[0]


def test_a_stop_inside_the_accepted_run_truncates_it() -> None:
    h = speculating(1.0, eos_at={"r": 4})
    request = h.add("r", 6, max_tokens=20)
    h.run()
    seq = request.seqs[0]
    assert seq.finish_reason is FinishReason.STOP
    assert seq.output_token_ids == h.reference(request)[0]
    assert len(seq.output_token_ids) == 4
    assert h.sched.kv.pool.num_free == h.cfg.num_gpu_blocks


def test_proposals_stop_at_max_tokens_and_min_tokens_still_holds() -> None:
    h = speculating(1.0, eos_at={"r": 2, "s": 3})
    first = h.add("r", 5, max_tokens=3)
    second = h.add("s", 5, max_tokens=12, min_tokens=5)
    h.run()
    for request in (first, second):
        seq = request.seqs[0]
        assert seq.output_token_ids == h.reference(request)[0]
    assert first.seqs[0].finish_reason is FinishReason.STOP  # EOS at 2 of 3
    assert len(second.seqs[0].output_token_ids) == 12  # EOS below min_tokens masked
    assert all(len(p.proposals.get("r", ())) <= 1 for p in h.plans)  # room for 2 after 1


def test_a_result_that_does_not_answer_the_proposal_is_a_protocol_error() -> None:
    h = speculating(1.0)
    h.add("r", 6, max_tokens=20)
    h.step()
    plan = h.sched.schedule()
    assert plan is not None
    proposal = plan.proposals["r"]
    wrong = [proposal[0] + 1, 5]  # "accepts" a token that was not proposed
    with pytest.raises(WorkerProtocolError, match="do not answer the proposal"):
        h.sched.update(StepResult(step=plan.step, sampled_token_ids={"r": wrong}))


def test_requests_may_turn_speculation_off_or_down() -> None:
    h = speculating(1.0)
    off = h.add("off", 6, max_tokens=10, num_speculative_tokens=0)
    down = h.add("down", 6, max_tokens=10, num_speculative_tokens=2)
    h.run()
    assert all("off" not in plan.proposals for plan in h.plans)
    assert max(len(plan.proposals.get("down", ())) for plan in h.plans) == 2
    assert off.seqs[0].output_token_ids == h.reference(off)[0]
    assert down.seqs[0].output_token_ids == h.reference(down)[0]


def test_speculation_plans_one_step_at_a_time_and_overlap_resumes_when_it_stops() -> None:
    h = speculating(1.0, overlap_scheduling=True)
    h.add("r", 6, max_tokens=40)
    h.step()
    h.sched.schedule()
    assert h.sched.inflight[-1].proposals
    assert not h.sched.can_plan_ahead()
    # Measured: a step costs its tokens only (no fixed part), so proposals never pay.
    policy = h.sched.speculation
    measured(policy, 0.0, 0.001)
    for _ in range(MIN_VERIFIED):
        policy.verified(4, 0)  # nothing accepted lately
    h.sched.update(h.worker.execute(h.sched.inflight[-1].output.plan))  # type: ignore[union-attr]
    plan = h.sched.schedule()
    assert plan is not None and not plan.proposals
    assert h.sched.can_plan_ahead()


def test_probes_land_under_overlap_while_speculation_is_off() -> None:
    """Backed off, one step in PROBE_INTERVAL still proposes with overlap on: a probe
    that falls due while a step is in flight (its sequence has nothing to propose from)
    stays due for the next step, which waits for that result."""
    h = speculating(1.0, overlap_scheduling=True)
    policy = h.sched.speculation
    measured(policy, 0.0, 0.001)  # a step costs its tokens only: proposals never pay
    for _ in range(MIN_VERIFIED):
        policy.verified(4, 0)
    request = h.add("r", 6, max_tokens=120)
    h.run()
    probes = sum(1 for plan in h.plans if plan.proposals)
    assert probes >= 2  # at steps 32 and 96 (the interval doubles)
    assert probes < len(h.plans) // 4  # and only the probes
    assert request.seqs[0].output_token_ids == h.reference(request)[0]


def measured(policy: SpeculationPolicy, fixed: float, per_token: float) -> None:
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        policy.timed(tokens, fixed + per_token * tokens)


def test_the_policy_proposes_as_far_as_the_last_token_pays() -> None:
    policy = SpeculationPolicy(4)
    measured(policy, 0.010, 0.0005)  # 10 ms a step, 0.5 ms a token
    for _ in range(MIN_VERIFIED):
        policy.verified(4, 2)  # always two accepted, the third rejected
    # the third token is never accepted: two pay at any batch size
    assert [policy.length(b) for b in (1, 8, 64)] == [2, 2, 2]
    assert policy.acceptance_rate == 0.5
    assert policy.accepted_per_position == [16, 16, 0, 0]


def test_the_policy_stops_proposing_where_a_batch_makes_it_a_loss() -> None:
    policy = SpeculationPolicy(4)
    measured(policy, 0.010, 0.0005)
    for _ in range(MIN_VERIFIED):  # each token accepted half the time
        for accepted in (0, 1, 0, 2, 0, 1, 0, 3):
            policy.verified(4, accepted)
    # token j is reached and accepted with 0.5**j; it pays while
    # 0.5**j * (10 + 0.5 B) / B > 0.5
    assert [policy.length(b) for b in (1, 8, 19)] == [3, 1, 1]  # the 4th: never accepted
    decisions = [policy.length(40) for _ in range(3 * MAX_PROBE_INTERVAL)]
    probes = [step + 1 for step, length in enumerate(decisions) if length]
    assert set(decisions) == {0, 4}  # probes only, with every token
    # each probe that leaves it off doubles the wait for the next, up to the cap
    assert probes[:5] == [32, 32 + 64, 96 + 128, 224 + 256, 480 + 256]
    assert policy.length(1) == 3  # paying again: back to the short interval
    decisions = [policy.length(40) for _ in range(PROBE_INTERVAL)]
    assert decisions.count(4) == 1


@pytest.mark.parametrize(("spec_s", "length"), [(0.273, 0), (0.060, 4)])
def test_a_policy_timed_on_one_step_size_measures_a_plain_step(spec_s: float, length: int) -> None:
    """Every decode speculating k (a draft model's, one sequence): the fit sees one step
    size, so the policy runs a plain step for the base cost, then decides from both."""
    policy = SpeculationPolicy(4)
    for _ in range(MIN_VERIFIED):
        policy.verified(4, 4)  # every draft accepted
        policy.timed(5, spec_s)
    assert policy.length(1) == 0  # a plain step, to measure
    policy.timed(1, 0.044)
    # 5 tokens in spec_s against 1 in 44 ms: a draft of 273 ms a step loses, one of 60 wins
    assert policy.length(1) == length


def test_a_policy_without_timings_backs_off_on_acceptance() -> None:
    policy = SpeculationPolicy(4)
    assert policy.length(1) == 4  # nothing measured: try
    for _ in range(MIN_VERIFIED):
        policy.verified(4, 0)
    assert [policy.length(1) for _ in range(PROBE_INTERVAL)].count(4) == 1
    assert SpeculationPolicy(0).length(1) == 0
    assert SpeculationPolicy(4, backoff=False).length(1) == 4


def test_forks_speculate_each_on_their_own() -> None:
    h = speculating(0.7)
    request = h.add("r", 6, max_tokens=16, n=3, temperature=1.0)
    h.run()
    assert [seq.seq_id for seq in request.seqs] == ["r/0", "r/1", "r/2"]
    for seq in request.seqs:
        assert seq.output_token_ids == h.reference(request, seq.sample_index)[0]
    proposed = {seq_id for plan in h.plans for seq_id in plan.proposals}
    assert proposed == {"r/0", "r/1", "r/2"}


def test_a_lost_worker_drops_proposals_with_the_step() -> None:
    h = speculating(1.0)
    request = h.add("r", 6, max_tokens=30)
    h.step()
    plan = h.sched.schedule()
    assert plan is not None and plan.proposals
    h.sched.on_worker_lost()
    assert check_invariants(h.sched) == []
    restart_worker(h)
    h.run()
    seq = request.seqs[0]
    assert seq.status is SeqStatus.FINISHED
    assert seq.output_token_ids == h.reference(request)[0]


def test_the_config_pairs_prompt_lookup_sizes() -> None:
    with pytest.raises(msgspec.ValidationError, match="prompt_lookup_min"):
        msgspec.convert({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, SchedulerConfig)
