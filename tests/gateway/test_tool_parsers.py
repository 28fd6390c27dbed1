"""Tool calls read from model outputs (``expeditor.gateway.tool_parsers``): fixed outputs
of each supported format, whole and streamed in every split; random calls written in
each format read back exactly; the grammar that forces calls accepts what the reader
reads and nothing that breaks the tools' schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from expeditor.gateway.tool_parsers import PARSERS, ToolCallReader, parse_tool_calls, tool_format
from gpu_worker.model_source import resolve_model
from scheduler_svc.structured_output import GrammarCompiler
from shared.structured_output import StructuredOutput

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}'
CALLS = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"tz": "Asia/Tokyo"}')]

FIXED: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    # Hermes / Qwen: content, then one block per call
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n"
     "</tool_call>", "Let me check.", CALLS),
    ("hermes", f"<tool_call>{WEATHER}</tool_call>", "", CALLS[:1]),
    ("hermes", "No tools needed: 2 < 3 and a <b> tag.", "No tools needed: 2 < 3 and a <b> tag.",
     []),
    # keys in either order; braces, quotes and escapes inside strings
    ("hermes", '<tool_call>\n{"arguments": {"q": "a}b\\"{c", "n": [1, {"m": null}]}, '
     '"name": "search"}\n</tool_call>', "",
     [("search", '{"q": "a}b\\"{c", "n": [1, {"m": null}]}')]),
    # cut short mid-arguments (finish_reason length): what was read
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     "", [("get_weather", '{"city": "Pa')]),
    # no arguments: {}
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    # the format broken: content from the marker
    ("hermes", "see <tool_call>not json</tool_call>", "see <tool_call>not json</tool_call>", []),
    ("hermes", 'x <tool_call>{"id": 1}</tool_call>', 'x <tool_call>{"id": 1}</tool_call>', []),
    # a name that is no function's (prose, a lone surrogate): not a call
    ("hermes", '<tool_call>{"name": "not a tool!", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "not a tool!", "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
    # content on both sides of a call keeps one gap
    ("hermes", f"Use x <tool_call>{TIME}</tool_call> then y.", "Use x then y.", CALLS[1:]),
    # Llama 3: the whole output, ';' between calls, optional python tag
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
     '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}', "", CALLS),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}',
     "", CALLS[1:]),
    ("llama3_json", 'The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    # Mistral: [TOOL_CALLS] and a list (v3), or name[ARGS]{...} per call (v11)
    ("mistral", f"Sure.[TOOL_CALLS][{WEATHER}, {TIME}]", "Sure.", CALLS),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}'
     '[TOOL_CALLS]get_time[ARGS]{"tz": "Asia/Tokyo"}', "", CALLS),
    ("mistral", "Plain [TOOLS] text", "Plain [TOOLS] text", []),
    # [TOOL_CALLS] is a special token the text may have lost: a list at the start
    ("mistral", f" [{WEATHER}, {TIME}]", "", CALLS),
    ("mistral", "[1, 2] and [link](x)", "[1, 2] and [link](x)", []),
    ("mistral", f"[{{not json}}] then[TOOL_CALLS][{TIME}]", "[{not json}] then", CALLS[1:]),
    ("mistral", "[TOOL_CALLS]Sorry, I can't.\nHere: [ARGS]{}",
     "[TOOL_CALLS]Sorry, I can't.\nHere: [ARGS]{}", []),
]  # fmt: skip


def read_whole(fmt: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(fmt, text)
    return content, [(c.name, c.arguments) for c in calls]


def read_streamed(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a client assembles from the deltas (each call's name
    arriving once, before any of its arguments)."""
    reader = ToolCallReader(tool_format(fmt))
    content = ""
    calls: dict[int, list[str]] = {}
    for number, piece in enumerate(pieces + [""]):
        text, deltas = reader.feed(piece, final=number == len(pieces))
        content += text
        for delta in deltas:
            if delta.name is not None:
                assert delta.index not in calls, "a call's name is sent once"
                assert delta.index == len(calls), "calls arrive in order"
                calls[delta.index] = [delta.name, ""]
            assert delta.index in calls, "arguments only after the name"
            calls[delta.index][1] += delta.arguments
    return content, [(name, args) for name, args in calls.values()]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), FIXED)
def test_fixed_outputs_read_whole_and_in_every_split(
    fmt: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    assert read_whole(fmt, text) == (content, calls)
    assert read_streamed(fmt, list(text)) == (content, calls)
    for cut in range(len(text) + 1):
        assert read_streamed(fmt, [text[:cut], text[cut:]]) == (content, calls), cut


def test_arguments_stream_as_they_are_generated() -> None:
    """Each argument character goes out once it is read (trailing whitespace waits)."""
    reader = ToolCallReader(tool_format("hermes"))
    _, deltas = reader.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert [(d.name, d.arguments) for d in deltas] == [("f", '{"city": "Par')]
    _, deltas = reader.feed('is",  ')
    assert [d.arguments for d in deltas] == ['is",']
    _, deltas = reader.feed('"n": 2}}\n</tool_call>')
    assert [d.arguments for d in deltas] == ['  "n": 2}']


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,11}", fullmatch=True)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
SPACES = st.sampled_from(["", " ", "\n", "  \n"])


def write_calls(fmt: str, calls: list[tuple[str, dict[str, Any]]], style: Any) -> str:
    """Calls as a model of family ``fmt`` writes them."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objects = [
        json.dumps({"name": name, key: args}, indent=style.draw(st.sampled_from([None, 2])))
        for name, args in calls
    ]
    gap = style.draw(SPACES)
    if fmt == "hermes":
        return gap.join(f"<tool_call>{gap}{o}{gap}</tool_call>" for o in objects)
    if fmt == "llama3_json":
        return (";" + gap).join(objects)
    return "[TOOL_CALLS][" + ("," + gap).join(objects) + "]"


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(sorted(PARSERS)),
    calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
    content=st.text(alphabet="abc xyz.\n<>[]{}", max_size=20),
    data=st.data(),
)
def test_random_calls_read_back_whole_and_streamed(
    fmt: str, calls: list[tuple[str, dict[str, Any]]], content: str, data: st.DataObject
) -> None:
    written = write_calls(fmt, calls, data)
    content = content.strip()
    if fmt == "llama3_json" or "[TOOL_CALLS]" in content or "<tool_call>" in content:
        content = ""  # llama3_json: an output with calls is only calls
    text = (content + " " if content else "") + written
    whole_content, whole_calls = read_whole(fmt, text)
    assert whole_content == content
    assert [(name, json.loads(args)) for name, args in whole_calls] == calls
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert read_streamed(fmt, pieces) == (whole_content, whole_calls)


# -- the grammar of forced calls ----------------------------------------------------------

TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    {"name": "get_time", "parameters": {"type": "object"}},
]


@pytest.fixture(scope="module")
def compiler() -> tuple[GrammarCompiler, Tokenizer]:
    tokenizer = Tokenizer.from_file(str(resolve_model("smollm2-135m-instruct") / "tokenizer.json"))
    return GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [2]), tokenizer


def accepts(compiler: tuple[GrammarCompiler, Tokenizer], grammar: str, text: str) -> bool:
    grammars, tokenizer = compiler
    constraint = grammars.compile(StructuredOutput(grammar=grammar))
    return all(constraint.accept(t) for t in tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_the_forcing_grammar_takes_calls_the_reader_reads(
    fmt: str, compiler: tuple[GrammarCompiler, Tokenizer]
) -> None:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    one = {"name": "get_weather", key: {"city": "Paris", "unit": "c"}}
    two = {"name": "get_time", key: {"tz": "UTC"}}
    sep = {"hermes": "\n", "llama3_json": "; ", "mistral": ", "}[fmt]

    def written(*objects: dict[str, Any]) -> str:
        body = json.dumps(list(objects))[1:-1].replace("}, {", "}" + sep + "{")
        if fmt == "hermes":
            return sep.join(f"<tool_call>\n{json.dumps(o)}\n</tool_call>" for o in objects)
        return f"[TOOL_CALLS][{body}]" if fmt == "mistral" else body

    grammar = tool_format(fmt).grammar(TOOLS, multiple=True)
    both = written(one, two)
    assert accepts(compiler, grammar, both)
    assert [c.name for c in parse_tool_calls(fmt, both)[1]] == [
        "get_weather",
        "get_time",
    ]
    single = tool_format(fmt).grammar(TOOLS, multiple=False)
    assert accepts(compiler, single, written(one))
    assert not accepts(compiler, single, both)
    bad_unit = {"name": "get_weather", key: {"city": "Paris", "unit": "kelvin"}}
    assert not accepts(compiler, grammar, written(bad_unit))
    extra = {"name": "get_weather", key: {"city": "Paris", "unit": "c", "x": 1}}
    assert not accepts(compiler, grammar, written(extra))
    assert not accepts(compiler, grammar, written({"name": "get_news", key: {}}))
