"""A sample that cannot go on fails its request: the worker drew no token for it
(``NO_TOKEN``: every token masked, or logits that overflowed), or its structured-output
matcher failed. Every sample of the request ends (``abort``), its blocks go back, the
step's output says why (the output path sends the client that), and the other requests
go on untouched."""

from __future__ import annotations

import pytest
from support.harness import Harness

from ipc.schema import NO_TOKEN, BatchPlan, StepResult
from scheduler_svc.core.request import Request
from shared.sampling import SamplingParams


def no_token_at(h: Harness, request: Request, sample_index: int, output_index: int) -> None:
    """The fake worker draws NO_TOKEN for that sample's ``output_index``-th token (the
    first tokens of every sample come in one list, sample 0's, on the fork step)."""
    execute = h.worker.execute

    def patched(plan: BatchPlan) -> StepResult:
        result = execute(plan)
        if output_index == 0:
            first = result.sampled_token_ids.get(request.seq_id(0))
            if first is not None and not request.seqs[0].output_token_ids:
                first[sample_index] = NO_TOKEN
            return result
        seq_id = request.seq_id(sample_index)
        seqs = [s for s in request.seqs if s.sample_index == sample_index]
        drawn = len(seqs[0].output_token_ids) if seqs else 0
        if seq_id in result.sampled_token_ids and drawn == output_index:
            result.sampled_token_ids[seq_id][-1] = NO_TOKEN
        return result

    h.worker.execute = patched  # type: ignore[method-assign]


@pytest.mark.parametrize(("n", "sample", "at"), [(1, 0, 2), (3, 2, 2), (3, 2, 0), (4, 1, 0)])
def test_a_sample_without_a_token_fails_its_request(n: int, sample: int, at: int) -> None:
    """``at`` 0 with n > 1: on the fork step, where a forked sample's failure must end
    the forking too (no sample is made for a request that has ended)."""
    h = Harness()
    free = h.sched.kv.pool.num_free
    bad = h.add("bad", 9, n=n, max_tokens=8, ignore_eos=True, allowed_token_ids=[3, 4])
    good = h.add("good", 7, max_tokens=8, ignore_eos=True)
    no_token_at(h, bad, sample, at)
    failed, ended = [], []
    while h.engine.has_work():
        output = h.step()
        failed += output.failed
        ended += output.finished_seqs
    assert failed == [
        (
            "bad",
            f"no token could be drawn at output token {at}: every token was masked, or the "
            "logits overflowed float32 (the request sets allowed_token_ids)",
        )
    ]  # once, however many samples the request has
    lengths = {seq.sample_index: len(seq.output_token_ids) for seq in bad.seqs}
    ends = sorted(e for e in ended if e[0] == "bad")
    assert ends == [("bad", i, "abort") for i in sorted(lengths)]
    assert lengths.get(sample, at) == at and max(lengths.values()) <= at + 1  # no NO_TOKEN
    assert good.seqs[0].finish_reason == "length" and len(good.seqs[0].output_token_ids) == 8
    assert h.sched.kv.pool.num_free == free and not h.sched.requests


class Failing:
    """A matcher that fails on its ``at``-th token (as llguidance's does past its
    parser's limits)."""

    def __init__(self, at: int) -> None:
        self.at, self.taken = at, 0

    def mask(self) -> bytes:
        return b"\xff\xff\xff\xff"

    def accept(self, token: int) -> bool:
        self.taken += 1
        return self.taken < self.at

    def fork(self) -> Failing:
        return Failing(self.at)

    @property
    def done(self) -> bool:
        return self.taken >= self.at

    @property
    def error(self) -> str | None:
        return "Parser Error: too complex" if self.taken >= self.at else None


def test_a_failed_matcher_fails_its_request() -> None:
    h = Harness()
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"regex": "a+"})
    tokens = h.model.prompt("c", 6)
    request = h.sched.add_request("c", tokens, params, constraint=Failing(3))
    h.requests["c"] = request
    failed = []
    while h.engine.has_work():
        failed += h.step().failed
    assert failed == [("c", "structured_outputs: the matcher failed: Parser Error: too complex")]
    assert request.seqs[0].finish_reason == "abort" and not h.sched.requests
