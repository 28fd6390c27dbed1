"""Tool calling through ``serve --http`` with the official openai client, on the real
SmolLM2 checkpoint and a Hermes-style tool template: forced calls (``required``, a named
function) validate against their tools' schemas, whole and streamed; ``auto`` reads the
calls the model writes, several in one answer, streamed and not; the tools and a tool
conversation reach the template as transformers renders them; bad tools are 400s
naming the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from support.http import post_json
from support.serve import running_http_serve
from transformers import AutoTokenizer

from expeditor.gateway.tool_parsers import parse_tool_calls
from gpu_worker.model_source import resolve_model

NAME = "smollm2-135m-instruct"
TEMPLATE = Path(__file__).parent.parent / "support" / "hermes_tools.jinja"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather "
     "forecast for a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time "
     "in a timezone", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def served() -> tuple[openai.OpenAI, str]:
    flags = ("--max-num-seqs", "16", "--chat-template", str(TEMPLATE))
    with running_http_serve(Path(NAME), *flags, timeout_s=300) as (_, url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), url


def check_calls(calls: list[Any], finish_reason: str) -> None:
    """Every call's arguments validate; a call cut by max_tokens is the last one."""
    assert calls, "a forced choice always calls"
    complete = calls if finish_reason == "tool_calls" else calls[:-1]
    assert finish_reason in ("tool_calls", "length")
    for call in complete:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


def streamed(client: openai.OpenAI, **request: Any) -> tuple[list[dict[str, Any]], str, str]:
    """A streamed answer's calls as the client assembles them, its content, its finish."""
    calls: dict[int, dict[str, Any]] = {}
    content, finish = "", ""
    for chunk in client.chat.completions.create(model=NAME, stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in calls and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
            calls[delta.index]["args"] += delta.function.arguments or ""
    return list(calls.values()), content, finish


def test_required_and_named_calls_validate_whole_and_streamed(served) -> None:
    client, _ = served
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        reply = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160,
            temperature=temperature, seed=seed, n=2,
        )  # fmt: skip
        for choice in reply.choices:
            assert choice.message.content is None
            check_calls(choice.message.tool_calls, choice.finish_reason)
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call], reply.choices[0].finish_reason)
    # streamed: the same calls, arguments joined from their deltas
    for choice in ("required", named):
        whole = client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=160,
            temperature=0,
        )  # fmt: skip
        calls, content, finish = streamed(
            client, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=160, temperature=0
        )
        message = whole.choices[0].message
        expected = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert [(c["name"], c["args"]) for c in calls] == expected
        assert (content, finish) == ("", whole.choices[0].finish_reason)


def check_one_forced_call(client: openai.OpenAI) -> None:
    """tool_choice required without parallel calls: exactly one call, complete, valid."""
    reply = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160,
        temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    check_calls([call], reply.choices[0].finish_reason)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call(served) -> None:
    check_one_forced_call(served[0])


WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME_CALL = {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}
BOTH = (WEATHER_CALL, TIME_CALL)
REPEAT = {
    "hermes": "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in BOTH),
    "llama3_json": "; ".join(
        json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in BOTH
    ),
    "mistral": "[TOOL_CALLS]" + json.dumps(list(BOTH)),
}
"""Two calls as each format writes them, for the model to copy."""


def copy(fmt: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You copy text exactly."},
        {"role": "user", "content": "Repeat exactly, with nothing else:\n" + REPEAT[fmt]},
    ]


def check_auto(client: openai.OpenAI, fmt: str) -> None:
    """The model (asked to copy two calls) writes them; auto reads exactly what the
    same request without reading (tool_choice none) shows as plain text, whole and
    streamed."""
    ask = copy(fmt)
    plain = client.chat.completions.create(
        model=NAME, messages=ask, tools=TOOLS, tool_choice="none", max_tokens=120, temperature=0
    )
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
    content, expected = parse_tool_calls(fmt, text)
    assert len(expected) >= 2, text  # several calls in one answer
    reply = client.chat.completions.create(
        model=NAME, messages=ask, tools=TOOLS, max_tokens=120, temperature=0
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content == (content or None)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.name, c.arguments) for c in expected
    ]
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, streamed_content, finish = streamed(
        client, messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=120, temperature=0
    )
    assert [(c["name"], c["args"]) for c in calls] == [(c.name, c.arguments) for c in expected]
    assert (streamed_content, finish) == (content, "tool_calls")


def test_auto_reads_the_calls_the_model_writes(served) -> None:
    client, _ = served
    check_auto(client, "hermes")
    # without tools the same server answers with content
    bare = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
    )
    assert bare.choices[0].finish_reason in ("stop", "length") and bare.choices[0].message.content


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
def test_the_other_formats_end_to_end(fmt: str) -> None:
    """With --tool-call-parser FMT: auto reads calls written in FMT, and a forced call
    is written in FMT and validates."""
    flags = ("--max-num-seqs", "4", "--chat-template", str(TEMPLATE), "--tool-call-parser", fmt)
    with running_http_serve(Path(NAME), *flags, timeout_s=300) as (_, url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        check_auto(client, fmt)
        check_one_forced_call(client)


def test_tools_and_a_tool_conversation_render_as_transformers_does(served) -> None:
    _, url = served
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(NAME))
    expected = tokenizer.apply_chat_template(
        conversation, tools=TOOLS, chat_template=TEMPLATE.read_text(), add_generation_prompt=True,
        tokenize=True,
    )  # fmt: skip
    expected = list(getattr(expected, "input_ids", expected))
    status, got = post_json(
        url, "/tokenize", {"messages": conversation, "tools": TOOLS}, timeout=30
    )
    assert status == 200, got
    assert got["tokens"] == expected
    assert b"<tool_response>" in tokenizer.decode(got["tokens"]).encode()
    client, _ = served
    reply = client.chat.completions.create(
        model=NAME, messages=conversation, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert reply.usage.prompt_tokens == len(expected)


def test_bad_tools_are_400s_naming_the_problem(served) -> None:
    client, _ = served
    fn = {"name": "f", "parameters": {"type": "object"}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "letters"),
        ({"tools": [{"type": "function", "function": fn}] * 2}, "given twice"),
        ({"tools": [{"type": "function", "function": fn}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "no tool named 'g'"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": fn}], "tool_choice": "sometimes"},
         "tool_choice: expected"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strng"}}}}}],
          "tool_choice": "required"}, "strng"),
        ({"tools": [{"type": "function", "function": fn}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "one structured-output form"),
        ({"functions": [fn]}, "give tools instead"),
    ]  # fmt: skip
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, extra_body=extra)
        assert words in str(info.value), (extra, info.value)
    plain = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4)
    assert plain.choices[0].message.content
