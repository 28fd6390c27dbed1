"""Structured output in the core: a constrained sample's plan carries its mask on the
steps it draws (never on a non-final prefill chunk), the mask follows every token it
accepted (with overlapped scheduling it is planned only once its token is back), forks
copy the parent's matcher before the parent takes its own token, and a complete match
or a refused token ends the sample with ``stop``.

A recording constraint stands in for llguidance's matcher: its mask is the number of
tokens it accepted (4 bytes), so each plan shows what state its mask came from."""

from __future__ import annotations

import pytest
from support.harness import Harness

from ipc.schema import ErrorCode
from scheduler_svc.core.request import RejectedError
from shared.sampling import SamplingParams

JSON = {"structured_outputs": {"json_object": True}}


class Recording:
    def __init__(self, accepted: list[int] | None = None, *, done_after: int = 10_000,
                 refuse: int | None = None) -> None:  # fmt: skip
        self.accepted = list(accepted or [])
        self.done_after = done_after
        self.refuse = refuse
        self.forks: list[Recording] = []

    def mask(self) -> bytes:
        return len(self.accepted).to_bytes(4, "little")

    def accept(self, token: int) -> bool:
        if self.refuse is not None and len(self.accepted) == self.refuse:
            return False
        self.accepted.append(token)
        return True

    def fork(self) -> Recording:
        child = Recording(self.accepted, done_after=self.done_after, refuse=self.refuse)
        self.forks.append(child)
        return child

    @property
    def done(self) -> bool:
        return len(self.accepted) >= self.done_after

    @property
    def error(self) -> str | None:
        return None  # a refused token without a failed matcher: the sample just stops


def add(h: Harness, request_id: str, prompt: int, constraint: Recording, **params: object):
    tokens = h.model.prompt(request_id, prompt)
    params = {"temperature": 0.0, **JSON, **params}
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    request = h.sched.add_request(request_id, tokens, sampling, constraint=constraint)
    h.requests[request_id] = request
    return request


@pytest.mark.parametrize("overlap", [False, True])
def test_masks_ride_on_drawing_steps_and_follow_every_accepted_token(overlap: bool) -> None:
    h = Harness(max_num_batched_tokens=8, overlap_scheduling=overlap)
    constraint = Recording()
    request = add(h, "c", 20, constraint, max_tokens=6, ignore_eos=True)
    h.add("plain", 5, max_tokens=12, ignore_eos=True)
    while h.engine.has_work():
        h.step()
    seq = request.seqs[0]
    drew = [p for p in h.plans if "c" in p.num_scheduled_tokens and "c" in p.token_masks]
    chunks = [p for p in h.plans if "c" in p.num_scheduled_tokens and "c" not in p.token_masks]
    # 20 prompt tokens in chunks of <= 8: two chunks draw nothing, the third draws
    assert len(drew) == 6 and len(chunks) == 2
    assert [int.from_bytes(p.token_masks["c"], "little") for p in drew] == list(range(6))
    assert all("plain" not in p.token_masks for p in h.plans)
    assert constraint.accepted == seq.output_token_ids and seq.finish_reason == "length"


def test_forks_copy_the_matcher_before_the_parent_takes_its_token() -> None:
    h = Harness()
    constraint = Recording()
    request = add(h, "f", 6, constraint, max_tokens=4, n=3, temperature=1.0, ignore_eos=True)
    h.run()
    assert len(constraint.forks) == 2
    matchers = [constraint, *constraint.forks]
    for seq in request.seqs:
        assert matchers[seq.sample_index].accepted == seq.output_token_ids, seq.seq_id
    assert len({tuple(s.output_token_ids) for s in request.seqs}) > 1  # they did differ


def test_a_complete_match_or_a_refused_token_ends_the_sample() -> None:
    h = Harness()
    done = add(h, "done", 5, Recording(done_after=3), max_tokens=10, ignore_eos=True)
    refused = add(h, "refused", 5, Recording(refuse=2), max_tokens=10, ignore_eos=True)
    ended = []
    while h.engine.has_work():
        ended += h.step().finished_seqs  # what the output path learns of each end
    assert sorted(ended) == [("done", 0, "stop"), ("refused", 0, "stop")]
    assert [len(done.seqs[0].output_token_ids), done.seqs[0].finish_reason] == [3, "stop"]
    # the refused token is the output's last: it was drawn, then the match could not go on
    assert [len(refused.seqs[0].output_token_ids), refused.seqs[0].finish_reason] == [3, "stop"]


def test_a_constraint_goes_with_structured_outputs_and_only_with_them() -> None:
    h = Harness()
    message = r"^structured_outputs: a constraint goes with them and only with them$"
    with pytest.raises(RejectedError, match=message) as info:
        h.sched.add_request("a", [1, 2], SamplingParams(**JSON))  # type: ignore[arg-type]
    assert info.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(RejectedError, match=message) as info:
        h.sched.add_request("b", [1, 2], SamplingParams(), constraint=Recording())
    assert info.value.code == ErrorCode.BAD_REQUEST
