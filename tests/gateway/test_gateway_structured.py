"""Structured output through ``serve --http`` with the official openai client: chat
``response_format`` JSON schemas on the real SmolLM2 checkpoint (whole and streamed,
n=2) validate; vLLM's and llama.cpp's forms reach the engine; bad constraints and a
compile past the time limit are 400s naming the problem while plain requests are
served."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from support.schemas import schemas
from support.serve import running_http_serve

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real() -> openai.OpenAI:
    with running_http_serve(Path(NAME), "--max-num-seqs", "16", timeout_s=300) as (_, url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_chat_json_schemas_validate_whole_and_streamed(real: openai.OpenAI) -> None:
    family = schemas(seed=3, count=6)
    for index, schema in enumerate(family):
        messages = [{"role": "user", "content": f"A JSON object for: {json.dumps(schema)}"}]
        form = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}}
        reply = real.chat.completions.create(
            model=NAME, messages=messages, max_tokens=120, response_format=form, n=2,
            temperature=1.0, seed=index,
        )  # fmt: skip
        for choice in reply.choices:
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), schema)
            else:
                assert choice.finish_reason == "length"
        if index < 2:
            chunks = real.chat.completions.create(
                model=NAME, messages=messages, max_tokens=120, response_format=form,
                temperature=0, stream=True,
            )  # fmt: skip
            chunks = [c for c in chunks if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop", text
            jsonschema.validate(json.loads(text), schema)


def test_every_form_reaches_the_engine(real: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Answer with a color."}]
    colors = ["red", "green", "blue"]
    forms = [
        {"structured_outputs": {"choice": colors}},
        {"guided_choice": colors},
        {"guided_regex": "(red|green|blue)"},
        {"grammar": 'root ::= "red" | "green" | "blue"'},
    ]
    for extra in forms:
        reply = real.chat.completions.create(
            model=NAME, messages=ask, max_tokens=8, temperature=0, extra_body=extra
        )
        assert reply.choices[0].message.content in colors, extra
    reply = real.completions.create(
        model=NAME, prompt="My phone number is ", max_tokens=20, temperature=0,
        extra_body={"guided_regex": r"\d{3}-\d{4}"},
    )  # fmt: skip
    assert re.fullmatch(r"\d{3}-\d{4}", reply.choices[0].text)
    obj = real.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
        max_tokens=80, temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.fixture(scope="module")
def impatient(model: Path) -> openai.OpenAI:
    """The tiny model, with a compile limit no grammar meets."""
    flags = ("--grammar-compile-timeout-s", "0.000001")
    with running_http_serve(model, *flags) as (_, url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_bad_constraints_are_400s_naming_the_problem(real: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "hi"}]
    cases = [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "strng"),
        ({"guided_regex": "a(b"}, "regex"),
        ({"guided_json": {"type": "string", "format": "no-such-format"}}, "format"),
        ({"guided_json": {"type": "object", "description": "x" * (1 << 20)}}, "bytes"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output form"),
    ]
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            real.chat.completions.create(model=NAME, messages=ask, max_tokens=4, extra_body=extra)
        assert words in str(info.value), (extra, info.value)
    plain = real.chat.completions.create(model=NAME, messages=ask, max_tokens=4)
    assert plain.choices[0].message.content


def test_a_compile_past_the_time_limit_fails_only_its_request(impatient: openai.OpenAI) -> None:
    name = impatient.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="grammar_compile_timeout_s"):
        impatient.completions.create(
            model=name, prompt=[1, 5], max_tokens=4, extra_body={"guided_regex": "[a-z]+"}
        )
    plain = impatient.completions.create(model=name, prompt=[1, 5], max_tokens=4)
    assert plain.usage.completion_tokens == 4
