"""n > 1 samples forked when their prompt completes: each sample gets the token and the
logprobs of its own row of the fork step, and then its own rows.

Scenarios on the real Scheduler stepping a FakeWorker (see tests/core/test_scheduler_unit.py);
the fake worker samples no logprobs, so each step's result gets distinct made-up
entries per row, and the test follows where each row's entry goes.
"""

from __future__ import annotations

import msgspec
from support.harness import Harness

from ipc.schema import StepResult
from scheduler_svc.core.step_records import StepOutput


def with_row_logprobs(result: StepResult, step: int) -> StepResult:
    """``result`` with one distinct logprobs entry per sampled row: row ``i`` of
    sequence ``s`` maps its own token to ``-(100 * step + i)`` and names ``s`` and ``i``
    in a second, fake token id, so an entry shows whose it was."""
    logprobs = {
        seq_id: [
            {token: -float(100 * step + i), 10_000 + 100 * int(seq_id[-1]) + i: -99.0}
            for i, token in enumerate(tokens)
        ]
        for seq_id, tokens in result.sampled_token_ids.items()
    }
    return msgspec.structs.replace(result, logprobs=logprobs)


def by_seq(outcome: StepOutput) -> dict[str, dict[int, float]]:
    """The step's logprobs by the sequence that got each token (one token each here)."""
    return {outcome.advanced[at].seq_id: entry for at, entry in outcome.logprobs.items()}


def test_each_forked_sample_gets_the_logprobs_of_its_own_row() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=4, n=3, temperature=1.0, logprobs=1)
    plan = h.sched.schedule()
    assert plan is not None and plan.num_samples == {"r/0": 3}
    result = with_row_logprobs(h.worker.execute(plan), 0)
    tokens = result.sampled_token_ids["r/0"]
    assert result.logprobs is not None
    entries = result.logprobs["r/0"]
    outcome = h.sched.update(result)
    assert [s.seq_id for s in request.seqs] == ["r/0", "r/1", "r/2"]
    for index, seq in enumerate(request.seqs):
        assert seq.output_token_ids == [tokens[index]]
        assert by_seq(outcome)[seq.seq_id] is entries[index], seq.seq_id
        assert by_seq(outcome)[seq.seq_id] == {
            tokens[index]: -float(index),
            10_000 + index: -99.0,
        }
    # After the fork every sample has its own row.
    for step in range(1, 4):
        plan = h.sched.schedule()
        assert plan is not None
        result = with_row_logprobs(h.worker.execute(plan), step)
        outcome = h.sched.update(result)
        assert result.logprobs is not None
        for seq_id, seq_entries in result.logprobs.items():
            assert by_seq(outcome)[seq_id] == seq_entries[0]
            token = result.sampled_token_ids[seq_id][0]
            assert by_seq(outcome)[seq_id][token] == -float(100 * step)
    assert request.finished
    h.assert_reference_outputs()


def test_forked_samples_without_logprobs_get_none() -> None:
    h = Harness()
    request = h.add("r", 6, max_tokens=2, n=2, temperature=1.0)
    plan = h.sched.schedule()
    assert plan is not None
    outcome = h.sched.update(h.worker.execute(plan))
    assert outcome.logprobs == {}
    assert {seq_id for _, _, seq_id, _ in outcome.tokens} == {"r/0", "r/1"}
    h.run()
    assert request.finished
    h.assert_reference_outputs()
