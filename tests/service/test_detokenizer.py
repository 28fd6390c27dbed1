"""Incremental detokenization, stop strings, and the output processor's events."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from ipc.schema import BatchPlan, Delta, DeltaBatch, Finished, NewSeq
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.outputs import ClientRequest, OutputProcessor
from shared.outputs import PromptLogprobs
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer

TEXT = "héllo wörld ✓ 日本語 🎉 end"


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return load_tokenizer(model)


def step_output(
    tokens: list[tuple[str, int, str, int]],
    *,
    scheduled: list[tuple[str, int]] | None = None,
    num_scheduled_tokens: int = 0,
    **fields: object,
) -> StepOutput:
    """A step's output as ``Scheduler.update`` makes it: ``scheduled`` lists the
    (request id, prefix-hit tokens) of the requests its plan sent in full, and the plan
    computes ``num_scheduled_tokens`` tokens."""
    plan = BatchPlan(
        step=0,
        num_scheduled_tokens={"computed": num_scheduled_tokens} if num_scheduled_tokens else {},
        new_seqs=[
            NewSeq(
                seq_id=rid,
                request_id=rid,
                sample_index=0,
                token_ids=[1, 2, 3],
                num_prompt_tokens=3,
                num_computed_tokens=cached,
                block_ids=[0],
            )
            for rid, cached in scheduled or []
        ],
    )
    advanced = [  # what StepOutput.tokens reads of a sequence
        SimpleNamespace(request=SimpleNamespace(request_id=rid), sample_index=index, seq_id=sid)
        for rid, index, sid, _ in tokens
    ]
    new_tokens = [token for *_, token in tokens]
    return StepOutput(plan, [], [], {}, advanced, new_tokens, **fields)  # type: ignore[arg-type]


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_deltas_concatenate_to_the_text_and_hold_back_partial_utf8(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids(tokenizer, TEXT)]
    assert "".join(deltas) + detok.flush() == TEXT
    # Multi-byte characters arrive one byte-token at a time: no replacement characters.
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # the first bytes of a multi-byte character show nothing yet


@pytest.mark.parametrize("stop", ["wörld", "✓", "end", "o w"])
def test_stop_string_cuts_the_text_and_nothing_past_it_is_shown(
    tokenizer: Tokenizer, stop: str
) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=(stop, "never"))
    shown = ""
    fed = 0
    for token in ids(tokenizer, TEXT):
        shown += detok.add(token)
        fed += 1
        if detok.stopped:
            break
    expected = TEXT[: TEXT.find(stop)]
    assert detok.stopped and detok.text == expected and shown == expected
    assert detok.add(5) == "" and len(detok.token_ids) == fed  # later tokens are ignored


def test_no_stop_string_found_releases_held_back_text(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("zzzz",))
    shown = "".join(detok.add(t) for t in ids(tokenizer, TEXT))
    assert len(shown) <= len(TEXT) - 3  # the last len("zzzz") - 1 characters wait
    assert shown + detok.flush() == TEXT and not detok.stopped


@pytest.mark.parametrize("stop", [(), ("zzzz",)])
def test_an_output_ending_inside_a_character_streams_what_a_whole_decode_shows(
    tokenizer: Tokenizer, stop: tuple[str, ...]
) -> None:
    """A request can end (its length limit) after the first bytes of a multi-byte
    character: the flush shows them as a whole decode does, so a streamed answer and
    the same answer not streamed have the same text."""
    tokens = ids(tokenizer, "ab 日本")[:-1]  # the last character cut after two of its bytes
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    assert whole.endswith("\ufffd")
    streamed = IncrementalDetokenizer(tokenizer, stop)
    shown = "".join(streamed.add(t) for t in tokens)
    assert not shown.endswith("\ufffd")  # held back while more bytes could come
    assert shown + streamed.flush() == whole == streamed.text
    lazy = IncrementalDetokenizer(tokenizer, lazy=True)
    for token in tokens:
        lazy.push(token)
    assert lazy.flush() == whole


def test_a_lazy_detokenizer_decodes_once_at_the_end(tokenizer: Tokenizer) -> None:
    calls: list[int] = []

    class Counting:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    lazy = IncrementalDetokenizer(Counting(), lazy=True)  # type: ignore[arg-type]
    tokens = ids(tokenizer, TEXT)
    assert all(lazy.push(t) is None for t in tokens)
    assert calls == [] and lazy.text == ""
    assert lazy.flush() == TEXT == lazy.text
    assert calls == [len(tokens)] and lazy.token_ids == tokens
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tokenizer, stop=("x",), lazy=True)


def test_load_tokenizer_needs_a_fast_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_output_processor_streams_batched_deltas_then_finished(tokenizer: Tokenizer) -> None:
    sent: list[tuple[bytes, object]] = []
    stopped: list[str] = []
    proc = OutputProcessor(tokenizer, lambda c, m: sent.append((c, m)), stopped.append)
    for rid in ("a", "b"):
        proc.requests[rid] = ClientRequest(
            request_id=rid,
            client=b"c1",
            owner=b"c1",
            stream=True,
            params=SamplingParams(max_tokens=8, stop=("lo",) if rid == "b" else ()),
            prompt_token_ids=[1, 2],
            arrival=0.0,
        )
    tokens = ids(tokenizer, "hello")
    for step, token in enumerate(tokens):
        finished = step == len(tokens) - 1
        proc.on_step(
            step_output(
                [("a", 0, "a", token), ("b", 0, "b", token)],
                finished_seqs=[("a", 0, "length")] if finished else [],
                finished_requests=["a"] if finished else [],
                time=1.0 + step,
            )
        )
    batches = [m for _, m in sent if isinstance(m, DeltaBatch)]
    assert batches and all(len(b.deltas) == 2 for b in batches[:3])
    deltas_a = [d for b in batches for d in b.deltas if d.request_id == "a"]
    deltas_a += [m for _, m in sent if isinstance(m, Delta) and m.request_id == "a"]
    assert "".join(d.text for d in deltas_a) == "hello"
    assert deltas_a[-1].finish_reason == "length"
    # "b" completed its stop string "lo" with its last token: the core is told to stop it.
    assert stopped == ["b"]
    finished = {m.request_id: m for _, m in sent if isinstance(m, Finished)}
    assert finished["a"].completion.text == "hello"
    assert finished["a"].usage.completion_tokens == len(tokens)
    assert finished["a"].timings.ttft_s == 1.0
    proc.finish("b")
    b = next(m for _, m in sent if isinstance(m, Finished) and m.request_id == "b")
    assert b.completion.text == "hel" and b.completion.finish_reason == "stop"
    assert b.completion.samples[0].stop_reason == "lo"
    assert finished["a"].completion.samples[0].stop_reason is None  # ended by length
    assert b.completion.token_ids == tokens  # the token completing the stop string counts


def test_stop_reason_names_the_stop_token_and_queue_time_ends_at_planning(
    tokenizer: Tokenizer,
) -> None:
    sent: list[object] = []
    proc = OutputProcessor(tokenizer, lambda c, m: sent.append(m), lambda seq_id: None)
    stop_token = ids(tokenizer, "!")[0]
    for rid in ("token", "eos", "strings"):
        proc.requests[rid] = ClientRequest(
            request_id=rid,
            client=b"c",
            owner=b"c",
            stream=True,
            params=SamplingParams(stop_token_ids=(stop_token,), stop=("zz", "yz", "x")),
            prompt_token_ids=[1, 2, 3],
            arrival=10.0,
        )
    last = {"token": stop_token, "eos": 2, "strings": ids(tokenizer, "y")[0]}
    # Planned at 10.5 (the requests' queue time ends), the result processed at 12.0.
    proc.on_step(
        step_output(
            [(rid, 0, rid, ids(tokenizer, "a")[0]) for rid in last],
            scheduled=[(rid, 0) for rid in last],
            num_scheduled_tokens=9,
            planned_at=10.5,
            time=12.0,
        )
    )
    proc.on_step(
        step_output(
            [(rid, 0, rid, token) for rid, token in last.items()],
            finished_seqs=[("token", 0, "stop"), ("eos", 0, "stop")],
            finished_requests=["token", "eos"],
            num_scheduled_tokens=3,
            planned_at=12.1,
            time=13.0,
        )
    )
    # "ay" holds no stop string yet; "z" makes "ayz", which holds "yz" (listed second).
    proc.on_step(step_output([("strings", 0, "strings", ids(tokenizer, "z")[0])], time=14.0))
    proc.finish("strings")
    finished = {m.request_id: m for m in sent if isinstance(m, Finished)}
    assert finished["token"].completion.samples[0].stop_reason == stop_token
    assert finished["eos"].completion.samples[0].stop_reason is None
    assert finished["strings"].completion.samples[0].stop_reason == "yz"
    assert finished["strings"].completion.text == "a"
    deltas = [d for m in sent if isinstance(m, DeltaBatch) for d in m.deltas]
    deltas += [m for m in sent if isinstance(m, Delta)]
    last_deltas = {d.request_id: d for d in deltas if d.finish_reason is not None}
    assert last_deltas["token"].stop_reason == stop_token
    for rid in ("token", "eos"):
        assert finished[rid].timings.queue_s == pytest.approx(0.5)
        assert finished[rid].timings.ttft_s == pytest.approx(2.0)
    hist = proc.metrics.histograms()
    assert hist["request_queue_time_seconds"].sum == pytest.approx(3 * 0.5)
    assert hist["iteration_tokens_total"].count == 2  # the step that computed nothing is not one


def test_prompt_logprobs_are_kept_once_per_position_and_go_on_the_first_delta(
    tokenizer: Tokenizer,
) -> None:
    """Chunks of prompt logprobs (a recomputed prefill repeats positions: the first
    report of each is kept); the first Delta and the Completion carry them; a gap fails
    the request with an internal error instead of inventing positions."""
    sent: list[object] = []
    proc = OutputProcessor(tokenizer, lambda c, m: sent.append(m), lambda seq_id: None)
    for rid in ("a", "gap"):
        proc.requests[rid] = ClientRequest(
            request_id=rid, client=b"c", owner=b"c", stream=True,
            params=SamplingParams(max_tokens=4, prompt_logprobs=0),
            prompt_token_ids=[1, 2, 3, 4, 5], arrival=0.0,
        )  # fmt: skip

    def chunk(first: int, count: int, value: float) -> PromptLogprobs:
        return PromptLogprobs(
            first=first,
            entries=[{first + i: value} for i in range(count)],
            ranks=[first + i for i in range(count)],
        )

    proc.on_step(step_output([], prompt_logprobs=[("a", chunk(1, 2, -1.0))]))
    # recomputed from the start, further this time; then the gap
    proc.on_step(step_output([], prompt_logprobs=[("a", chunk(1, 3, -9.0))]))
    proc.on_step(step_output([], prompt_logprobs=[("gap", chunk(2, 2, -1.0))]))
    assert [(m.request_id, m.code) for m in sent] == [("gap", "internal")]
    assert "position 2 arrived before those of position 1" in sent[0].message
    token = ids(tokenizer, "a")[0]
    proc.on_step(step_output([("a", 0, "a", token)], prompt_logprobs=[("a", chunk(4, 1, -2.0))]))
    proc.on_step(step_output([("a", 0, "a", token)]))
    proc.finish("a")
    deltas = [m for m in sent if isinstance(m, Delta)]
    want = PromptLogprobs(
        first=1, entries=[{1: -1.0}, {2: -1.0}, {3: -9.0}, {4: -2.0}], ranks=[1, 2, 3, 4]
    )
    assert deltas[0].prompt_logprobs == want
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    (finished,) = [m for m in sent if isinstance(m, Finished)]
    assert finished.completion.prompt_logprobs == want
