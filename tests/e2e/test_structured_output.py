"""Structured output end to end through the in-process engine: JSON schemas from a
seeded family, regular expressions, choices and a GBNF grammar on the real SmolLM2
checkpoint (outputs parse and validate), the same constrained greedy outputs under
every schedule on the tiny model, and bad constraints refused by name."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from support.schemas import schemas
from transformers import AutoTokenizer

from expeditor.llm import LLM
from gpu_worker.model_source import resolve_model
from scheduler_svc.core.request import RejectedError
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from shared.structured_output import MAX_STRUCTURED_BYTES

DEVICE = os.environ.get("EXPEDITOR_TEST_DEVICE", "cpu")
"""Where the engine runs (``benchmarks/gpu_check.sh``: CUDA, the masks applied there)."""

ARITHMETIC = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""


def parses_arithmetic(text: str) -> bool:
    """A recursive-descent parser of :data:`ARITHMETIC`: the whole text is one expr."""
    at = 0

    def factor() -> bool:
        nonlocal at
        if at < len(text) and text[at] == "(":
            at += 1
            if not expr() or at >= len(text) or text[at] != ")":
                return False
            at += 1
            return True
        start = at
        while at < len(text) and text[at].isdigit():
            at += 1
        return at > start

    def chain(part: Callable[[], bool], ops: str) -> bool:
        nonlocal at
        if not part():
            return False
        while at < len(text) and text[at] in ops:
            at += 1
            if not part():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and at == len(text)


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    with LLM("smollm2-135m-instruct", device=DEVICE, dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def chat():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))

    def render(question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 return_dict=True)  # fmt: skip
        return list(rendered["input_ids"])

    return render


def test_real_model_json_schemas_validate(smollm2: LLM, chat) -> None:
    """24 schemas of the seeded family, greedy and at temperature 1 (seeded): every
    output that stopped parses and validates; one cut by max_tokens used all of them."""
    family = schemas(seed=11, count=24)
    prompts = [chat(f"Write one JSON object matching this schema: {json.dumps(s)}")
               for s in family]  # fmt: skip
    params = [
        SamplingParams(
            max_tokens=120,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            structured_outputs={"json": s},
        )
        for i, s in enumerate(family)
    ]
    done = smollm2.generate(prompts, params)
    stopped = 0
    for completion, s in zip(done, family, strict=True):
        if completion.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(completion.text), s)
        else:
            assert completion.finish_reason == "length"
            assert len(completion.token_ids) == 120
    assert stopped >= 18, f"only {stopped} of 24 finished"


def test_real_model_regex_choice_and_grammar(smollm2: LLM, chat) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    cities = ("Paris", "London", "Rome", "Berlin")
    done = smollm2.generate(
        [chat("Give me a US phone number."), chat("What is the capital of France?"),
         chat("Write an arithmetic expression that equals 10."), chat("Say a city.")],
        [
            SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": phone}),
            SamplingParams(temperature=0, max_tokens=10, structured_outputs={"choice": cities}),
            SamplingParams(temperature=0, max_tokens=30,
                           structured_outputs={"grammar": ARITHMETIC}),
            SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=10,
                           structured_outputs={"choice": cities}),
        ],
    )  # fmt: skip
    assert re.fullmatch(phone, done[0].text) and done[0].finish_reason == "stop"
    assert done[1].text in cities and done[1].finish_reason == "stop"
    assert done[2].finish_reason == "stop" and parses_arithmetic(done[2].text), done[2].text
    assert all(s.text in cities and s.finish_reason == "stop" for s in done[3].samples)


def test_the_reference_parser() -> None:
    assert parses_arithmetic("2+3*(4-1)") and parses_arithmetic("10")
    assert not parses_arithmetic("2+") and not parses_arithmetic("(2") and not parses_arithmetic("")


TINY_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"enum": ["x", "y", "zz"]},
                   "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}  # fmt: skip
CONSTRAINTS = [
    {"json": TINY_SCHEMA, "disable_any_whitespace": True},
    {"regex": "(ab|cd){1,3}e?[0-9]{2,4}"},
    {"choice": ["alpha", "beta", "gamma delta"]},
]
TINY_PROMPTS = [[1, 5, 6, 7], [1, *range(40, 70)], [1, 9, 9, 9, 200, 3], [1, 77, 13]]
SCHEDULES = {
    "chunked": {"max_num_batched_tokens": 8, "block_size": 4},
    "no-overlap": {"overlap_scheduling": False},
    "swap": {"num_gpu_blocks": 16, "block_size": 4, "preemption_mode": "swap"},
    "recompute": {"num_gpu_blocks": 16, "block_size": 4, "preemption_mode": "recompute"},
}


def _tiny_run(model: Path, schedule: dict) -> tuple[list[list[list[int]]], int]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, n=3, structured_outputs=c)
        for c in CONSTRAINTS * 2
    ][: len(TINY_PROMPTS)]
    with LLM(model, device=DEVICE, dtype="float32", **schedule) as llm:
        done = llm.generate(TINY_PROMPTS, params)
        preempted = sum(llm.scheduler.preemptions.values())
    return [[s.token_ids for s in c.samples] for c in done], preempted


@pytest.fixture(scope="module")
def tiny_baseline(model: Path) -> list[list[list[int]]]:
    outputs, _ = _tiny_run(model, {})
    return outputs


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_constrained_greedy_outputs_are_the_same_under_every_schedule(
    model: Path, tiny_baseline: list[list[list[int]]], schedule: str
) -> None:
    """Chunked prefill, overlap off, swap and recompute pressure, n=3 forks: the tiny
    model's constrained greedy outputs equal the default run's, token for token."""
    outputs, preempted = _tiny_run(model, SCHEDULES[schedule])
    assert outputs == tiny_baseline
    if "preemption_mode" in SCHEDULES[schedule]:
        assert preempted > 0, "the small pool was meant to preempt"


def test_tiny_model_outputs_match_their_constraints(model: Path) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
              for c in CONSTRAINTS]  # fmt: skip
    with LLM(model, device=DEVICE, dtype="float32") as llm:
        done = llm.generate(TINY_PROMPTS[:3], params)
    assert all(c.finish_reason == "stop" for c in done), [(c.text, c.finish_reason) for c in done]
    jsonschema.validate(json.loads(done[0].text), TINY_SCHEMA)
    assert re.fullmatch("(ab|cd){1,3}e?[0-9]{2,4}", done[1].text)
    assert done[2].text in ("alpha", "beta", "gamma delta")


def test_bad_constraints_are_refused_naming_the_problem(model: Path) -> None:
    with LLM(model, device=DEVICE, dtype="float32") as llm:
        for spec, words in (
            ({"json": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "strng"),
            ({"json": {"type": "string", "format": "no-such-format"}}, "format"),
            ({"regex": "a(b"}, "regex"),
            ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ):
            params = SamplingParams(max_tokens=4, structured_outputs=spec)
            with pytest.raises(RejectedError, match="structured_outputs") as info:
                llm.generate([[1, 5]], params)
            assert words in info.value.message, info.value.message
        # the engine serves on
        assert llm.generate([[1, 5]], SamplingParams(max_tokens=2))[0].token_ids
    huge = {"type": "object", "description": "x" * MAX_STRUCTURED_BYTES}
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STRUCTURED_BYTES} bytes"):
        SamplingParams(structured_outputs={"json": huge})


def test_requests_that_cannot_go_on_fail_naming_why(model: Path) -> None:
    """A matcher that fails while generating (a grammar past the parser's limits:
    llguidance's rows hold at most 2000 items) and constraints that leave no token (a
    choice its bad word forbids, allowed tokens that the regex cannot take) fail the
    request with the reason; a request beside them finishes as it would alone."""
    wide = "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))
    alone = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(model, device=DEVICE, dtype="float32") as llm:
        expected = llm.generate([[1, 7]], alone)[0].token_ids
        yes, letter = (llm.tokenizer.encode(w, add_special_tokens=False).ids for w in ("yes", "a"))
        for params, words in (
            (SamplingParams(max_tokens=6, n=2, structured_outputs={"grammar": wide}),
             "structured_outputs: the matcher failed"),
            (SamplingParams(temperature=0.0, max_tokens=6, bad_words_token_ids=[yes],
                            structured_outputs={"choice": ["yes"]}),
             "(the request sets bad_words, structured_outputs)"),
            (SamplingParams(max_tokens=6, allowed_token_ids=letter,
                            structured_outputs={"regex": "[0-9]+"}),
             "(the request sets allowed_token_ids, structured_outputs)"),
        ):  # fmt: skip
            with pytest.raises(RejectedError, match="prompt 1: ") as info:
                llm.generate([[1, 7], [1, 5]], [alone, params])
            assert info.value.code == "bad_request" and words in info.value.message, info.value
            assert not llm.scheduler.requests and not llm.outputs.requests
            assert llm.generate([[1, 7]], alone)[0].token_ids == expected
