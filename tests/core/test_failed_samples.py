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
    """The fake worker draws NO_TOKEN for that sample's ``output_index``-th token."""
    execute = h.worker.execute

    def patched(plan: BatchPlan) -> StepResult:
        result = execute(plan)
        seq_id = request.seq_id(sample_index)
        seqs = [s for s in request.seqs if s.sample_index == sample_index]
        drawn = len(seqs[0].output_token_ids) if seqs else 0
        if seq_id in result.sampled_token_ids and drawn == output_index:
            result.sampled_token_ids[seq_id][-1] = NO_TOKEN
        return result

    h.worker.execute = patched  # type: ignore[method-assign]


@pytest.mark.parametrize("n", [1, 3])
def test_a_sample_without_a_token_fails_its_request(n: int) -> None:
    h = Harness()
    free = h.sched.kv.pool.num_free
    bad = h.add("bad", 9, n=n, max_tokens=8, ignore_eos=True, allowed_token_ids=[3, 4])
    good = h.add("good", 7, max_tokens=8, ignore_eos=True)
    no_token_at(h, bad, n - 1, 2)
    failed, ended = [], []
    while h.engine.has_work():
        output = h.step()
        failed += output.failed
        ended += output.finished_seqs
    assert failed == [
        (
            "bad",
            "no token could be drawn at output token 2: every token was masked, or the "
            "logits overflowed float32 (the request sets allowed_token_ids)",
        )
    ]
    assert sorted(e for e in ended if e[0] == "bad") == [("bad", i, "abort") for i in range(n)]
    lengths = {seq.sample_index: len(seq.output_token_ids) for seq in bad.seqs}
    assert lengths[n - 1] == 2 and max(lengths.values()) <= 3  # NO_TOKEN not kept
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
