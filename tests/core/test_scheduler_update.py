"""Applying a step's result: the same stop rules on both ways :meth:`Scheduler.update`
takes (one plain token, and the general way for logprobs and n > 1 forks), and what
the step's output reports.

Scenarios on the real Scheduler; the results are written by hand so that a stop token
can arrive at any output index.
"""

from __future__ import annotations

import pytest
from support.harness import Harness

from ipc.schema import SeqStatus, StepResult
from scheduler_svc.core.introspection import check_invariants
from scheduler_svc.core.step_records import StepOutput, WorkerProtocolError
from shared.outputs import FinishReason, PromptLogprobs

STOP = 7
OTHER = 9


def step_with(h: Harness, tokens: dict[str, list[int]], logprobs: bool) -> StepOutput:
    """Plan a step and apply ``tokens`` as its result (with logprobs entries if asked)."""
    plan = h.sched.schedule()
    assert plan is not None
    entries = {s: [{t: -1.0} for t in ts] for s, ts in tokens.items()} if logprobs else None
    outcome = h.sched.update(StepResult(step=plan.step, sampled_token_ids=tokens, logprobs=entries))
    assert check_invariants(h.sched) == []
    return outcome


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
def test_a_stop_token_counts_only_past_min_tokens(logprobs: bool) -> None:
    h = Harness()
    params = {"logprobs": 1} if logprobs else {}
    request = h.add("r", 6, max_tokens=8, min_tokens=2, stop_token_ids=[STOP], **params)
    seq = request.seqs[0]
    for _ in range(2):  # outputs 1 and 2: within min_tokens
        outcome = step_with(h, {"r": [STOP]}, logprobs)
        assert seq.status is SeqStatus.RUNNING and outcome.finished_seqs == []
        assert (outcome.logprobs == {0: {STOP: -1.0}}) is logprobs
    outcome = step_with(h, {"r": [STOP]}, logprobs)  # output 3
    assert seq.status is SeqStatus.FINISHED and seq.finish_reason is FinishReason.STOP
    assert outcome.finished_seqs == [("r", 0, FinishReason.STOP)]
    assert outcome.finished_requests == ["r"]
    assert outcome.tokens == [("r", 0, "r", STOP)]
    assert seq.output_token_ids == [STOP, STOP, STOP]
    assert h.sched.finished_counts["stop"] == 1


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
def test_max_tokens_ends_with_length_and_is_reported(logprobs: bool) -> None:
    h = Harness()
    params = {"logprobs": 0} if logprobs else {}
    request = h.add("r", 6, max_tokens=2, stop_token_ids=[STOP], **params)
    outcome = step_with(h, {"r": [OTHER]}, logprobs)
    assert outcome.finished_seqs == []
    outcome = step_with(h, {"r": [OTHER]}, logprobs)
    seq = request.seqs[0]
    assert seq.finish_reason is FinishReason.LENGTH
    assert outcome.finished_seqs == [("r", 0, FinishReason.LENGTH)]
    assert outcome.finished_requests == ["r"]
    assert h.sched.finished_counts["length"] == 1


def test_forked_samples_stop_by_the_same_rules() -> None:
    # The fork step's tokens are the samples' first outputs: samples 0 and 2 draw the
    # stop token within min_tokens=1, so nobody stops yet.
    h = Harness()
    request = h.add("r", 6, max_tokens=4, n=3, min_tokens=1, stop_token_ids=[STOP])
    outcome = step_with(h, {"r/0": [STOP, OTHER, STOP]}, logprobs=False)
    assert [s.seq_id for s in request.seqs] == ["r/0", "r/1", "r/2"]
    assert outcome.finished_seqs == []
    assert sorted(outcome.tokens) == [
        ("r", 0, "r/0", STOP),
        ("r", 1, "r/1", OTHER),
        ("r", 2, "r/2", STOP),
    ]
    # Second outputs: past min_tokens, a stop token ends its sample only.
    outcome = step_with(h, {"r/0": [OTHER], "r/1": [STOP], "r/2": [STOP]}, logprobs=True)
    ended = set(outcome.finished_seqs)
    assert ended == {("r", 1, FinishReason.STOP), ("r", 2, FinishReason.STOP)}
    assert outcome.finished_requests == []
    assert request.seqs[0].status is SeqStatus.RUNNING
    outcome = step_with(h, {"r/0": [STOP]}, logprobs=False)
    assert outcome.finished_requests == ["r"]
    assert request.finish_reason is FinishReason.STOP
    assert [s.output_token_ids for s in request.seqs] == [
        [STOP, OTHER, STOP],
        [OTHER, STOP],
        [STOP, STOP],
    ]


def test_a_fork_step_reaching_max_tokens_ends_every_sample_with_length() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=1, n=2, temperature=1.0)
    outcome = step_with(h, {"r/0": [OTHER, OTHER + 1]}, logprobs=True)
    assert set(outcome.finished_seqs) == {
        ("r", 0, FinishReason.LENGTH),
        ("r", 1, FinishReason.LENGTH),
    }
    assert outcome.finished_requests == ["r"]
    assert request.finish_reason is FinishReason.LENGTH
    assert {outcome.advanced[at].seq_id for at in outcome.logprobs} == {"r/0", "r/1"}
    assert h.sched.kv.pool.num_free == h.cfg.num_gpu_blocks


@pytest.mark.parametrize("tokens", [[OTHER], [OTHER, OTHER], [OTHER] * 4])
def test_a_fork_step_must_sample_every_sample(tokens: list[int]) -> None:
    h = Harness()
    h.add("r", 6, max_tokens=4, n=3)
    plan = h.sched.schedule()
    assert plan is not None and plan.num_samples == {"r/0": 3}
    result = StepResult(step=plan.step, sampled_token_ids={"r/0": tokens})
    with pytest.raises(WorkerProtocolError, match=r"^r/0: expected 3 sampled tokens, got "):
        h.sched.update(result)


def test_prompt_logprobs_are_reported_under_their_request() -> None:
    """A step's prompt logprobs go out keyed by the request of the sequence that
    computed them; those of a sequence the core no longer has are dropped."""
    h = Harness()
    h.add("r", 6, max_tokens=2, prompt_logprobs=1)
    plan = h.sched.schedule()
    assert plan is not None
    chunk = PromptLogprobs(first=1, entries=[{5: -0.5}] * 5, ranks=[1] * 5)
    stale = PromptLogprobs(first=1, entries=[{5: -0.1}], ranks=[1])
    result = StepResult(
        step=plan.step,
        sampled_token_ids={"r": [OTHER]},
        prompt_logprobs={"r": chunk, "gone": stale},
    )
    outcome = h.sched.update(result)
    assert outcome.prompt_logprobs == [("r", chunk)]
