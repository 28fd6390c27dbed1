"""Tool calls in a model's output, as the model family writes them, read as the text
arrives: the content around them and, per call, its name and the raw JSON text of its
arguments (``--tool-call-parser``).

Formats (:data:`PARSERS`):

- ``hermes`` (Hermes, Qwen 2.5/3 and most ChatML tool templates):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call,
  content around them;
- ``llama3_json`` (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters":
  {...}}`` (``arguments`` read too), several separated by ``;``, after an optional
  ``<|python_tag|>``; an output that does not start with ``{`` is content;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": ...}``
  (v3 tokenizers) or ``name[ARGS]{...}`` per call (v11), content before it. The
  scheduler's text skips special tokens, and ``[TOOL_CALLS]`` is one in Mistral's
  tokenizers: an output that starts with a list of objects (``[{``) is read as calls
  too. (v11's ``[ARGS]`` is special as well: that form is read only where the text has
  its markers.)

One incremental reader (:class:`ToolCallReader`) serves a whole response and a stream
alike, so a streamed call's argument deltas join to exactly the whole response's
``arguments``. A call is reported once its name is complete; its arguments grow as they
are generated (trailing whitespace held back until more text comes). An output cut
short mid-call (``length``) keeps the calls and arguments read so far. Text that
breaks the format (no JSON object after the marker, a call without a string name) is
content from there on.

Each format also writes the grammar that makes a model emit calls of given tools in
that format (``tool_choice`` ``required`` or a named function: arguments constrained
to the tool's JSON schema), so forced calls read back with the same reader.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from expeditor.gateway.call_scanner import WHITESPACE as _WS
from expeditor.gateway.call_scanner import ObjectScanner

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name: a call named otherwise is not read as one."""

__all__ = [
    "NAME_PATTERN",
    "PARSERS",
    "ParsedCall",
    "ToolCallDelta",
    "ToolCallReader",
    "ToolFormat",
    "parse_tool_calls",
    "tool_format",
]


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """The arguments' JSON text as the model wrote it (``{}`` when it gave none)."""


@dataclass
class ToolCallDelta:
    """What one step added to call ``index``: its ``name`` the first time (else None),
    and more of its arguments' text."""

    index: int
    name: str | None
    arguments: str


@dataclass
class _Call:
    scanner: ObjectScanner
    name_sent: bool = False
    sent: int = 0
    """Characters of its arguments sent."""


class ToolFormat:
    """One model family's tool-call syntax (subclasses: one per format)."""

    NAME: ClassVar[str]
    ARGUMENT_KEYS: ClassVar[tuple[str, ...]] = ("arguments",)
    START: ClassVar[str] = "start: {calls}"
    """The grammar's start rule; ``{calls}``: where the calls go."""
    ITEM: ClassVar[str] = "call"
    """The rule of one call as written (``call`` itself, or a block around it)."""
    SEPARATOR: ClassVar[str]
    """Between two calls."""
    RULES: ClassVar[tuple[str, ...]] = ()
    """The format's other rules (``call`` and its alternatives are added)."""

    def grammar(self, tools: list[dict[str, Any]], multiple: bool) -> str:
        """A Lark grammar (llguidance's) of one call, or with ``multiple`` one or
        more, of the ``tools`` (``{"name", "parameters"}`` each) in this format."""
        calls = self.ITEM
        if multiple:
            calls += f" ({_lark_string(self.SEPARATOR)} {self.ITEM})*"
        return "\n".join([self.START.format(calls=calls), *self.RULES, *self._call_rules(tools)])

    def _call_rules(self, tools: list[dict[str, Any]]) -> list[str]:
        """``call`` and its alternatives: ``{"name": "N", "<key>": <schema>}``."""
        key = self.ARGUMENT_KEYS[0]
        rules = ["call: " + " | ".join(f"call{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            head = _lark_string('{"name": ' + json.dumps(tool["name"]) + f', "{key}": ')
            rules.append(f'call{i}: {head} args{i} "}}"')
            rules.append(f"args{i}: %json {json.dumps(tool['parameters'])}")
        return rules


def _lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


class Hermes(ToolFormat):
    NAME = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    ITEM = "block"
    SEPARATOR = "\n"
    RULES = ('block: "<tool_call>\\n" call "\\n</tool_call>"',)


class Llama3Json(ToolFormat):
    NAME = "llama3_json"
    ARGUMENT_KEYS = ("parameters", "arguments")
    TAG = "<|python_tag|>"
    SEPARATOR = "; "


class Mistral(ToolFormat):
    NAME = "mistral"
    OPEN = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    START = 'start: "[TOOL_CALLS][" {calls} "]"'
    SEPARATOR = ", "


PARSERS: dict[str, type[ToolFormat]] = {f.NAME: f for f in (Hermes, Llama3Json, Mistral)}
"""``--tool-call-parser`` values."""


def tool_format(name: str) -> ToolFormat:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose from {', '.join(PARSERS)}"
        ) from None


def _held_prefix(text: str, start: int, marker: str) -> int:
    """Where a possible beginning of ``marker`` at the end of ``text[start:]`` starts
    (``len(text)`` if none): text from there is held back until more arrives."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - size :]):
            return len(text) - size
    return len(text)


@dataclass
class ToolCallReader:
    """The content and tool calls of one output, fed its text as it grows.

    Content is sent as it is decided, less whitespace: whitespace before a call's
    marker and right after a call is dropped, and trailing whitespace waits for more
    content (released at the end only when the output has no calls)."""

    fmt: ToolFormat
    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    pos: int = 0
    """Text before this offset is decided (content sent, or part of a call)."""
    state: str = "content"
    """content | open (a call object starts here) | object (reading one) | after
    (behind a call) | plain (content to the end); mistral also: start (a list at
    the very start?), list_or_name, in_list, name (v11: a name up to [ARGS]),
    open_named."""
    name: str | None = None
    """Mistral v11: the name read before [ARGS]."""
    held: list[str] = field(default_factory=list)
    """Whitespace waiting for content to follow it (dropped at the end of an output
    with calls)."""
    after_call: bool = False
    broken_at: int = 0
    """Where the marker or separator read last starts: content from there if what
    follows breaks the format."""
    scanned: int = 0
    """Text from ``pos`` up to here is whitespace (:meth:`_solid` reads each once)."""
    open_from: int = 0
    """Calls before this index have sent everything they will."""
    guessed: bool = False
    """Mistral: reading a list at the start as calls without its marker."""

    def __post_init__(self) -> None:
        if isinstance(self.fmt, Mistral):
            self.state = "start"

    def feed(self, more: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Read ``more``: (new content, new call deltas). ``final``: the output ended
        (held-back text is released)."""
        self.text += more
        out: list[str] = []
        while self._step(out, final):
            pass
        if final:
            if self.state in ("content", "plain") and self.pos < len(self.text):
                self._emit(out, self.text[self.pos :])
                self.pos = len(self.text)
            if not self.calls:
                out.extend(self.held)
            self.held = []
        return "".join(out), self._deltas(final)

    # -- content -----------------------------------------------------------------------

    def _emit(self, out: list[str], piece: str) -> None:
        """Content, its whitespace held until more content follows; the whitespace
        right after a call is dropped when some came before it (one gap, not two)."""
        rest = piece.lstrip(_WS)
        lead = piece[: len(piece) - len(rest)]
        if self.after_call and self.held:
            lead = ""
        if not rest:
            if lead:
                self.held.append(lead)
            return
        self.after_call = False
        solid = rest.rstrip(_WS)
        out.extend(self.held)
        out.append(lead + solid)
        trail = rest[len(solid) :]
        self.held = [trail] if trail else []

    def _content_until(self, out: list[str], marker: str, final: bool) -> bool:
        """Send content up to ``marker`` (a possible start of it at the end held back);
        whether the marker was found (``pos`` then behind it)."""
        text, pos = self.text, self.pos
        cut = text.find(marker, pos)
        if cut >= 0:
            self._emit(out, text[pos:cut])
            self.broken_at = cut
            self.pos = cut + len(marker)
            return True
        upto = len(text) if final else _held_prefix(text, pos, marker)
        if upto > pos:
            self._emit(out, text[pos:upto])
            self.pos = upto
        return False

    def _solid(self) -> int:
        """The first non-whitespace offset from ``pos`` (``len(text)`` if none); the
        whitespace is read once however many feeds it takes to end."""
        text = self.text
        pos = max(self.pos, self.scanned)
        while pos < len(text) and text[pos] in _WS:
            pos += 1
        self.scanned = pos
        return pos

    def _waiting_for(self, marker: str, at: int, final: bool) -> bool:
        """Whether the text from ``at`` may still become ``marker``."""
        return not final and marker.startswith(self.text[at:])

    # -- the state machine -------------------------------------------------------------

    def _step(self, out: list[str], final: bool) -> bool:
        """One move; False when it needs more text."""
        state = self.state
        if state == "plain":
            if self.pos < len(self.text):
                self._emit(out, self.text[self.pos :])
                self.pos = len(self.text)
            return False
        if state in ("open", "open_named"):
            return self._open(final, named=state == "open_named")
        if state == "object":
            return self._read_object()
        if isinstance(self.fmt, Llama3Json):
            return self._step_llama(final)
        if isinstance(self.fmt, Mistral):
            return self._step_mistral(out, final)
        return self._step_hermes(out, final)

    def _broken(self) -> None:
        """The format broke: content from the marker (or separator) read last."""
        self.pos = self.scanned = self.broken_at
        self.state = "content" if self.guessed else "plain"  # a marker may still come
        self.guessed = False

    def _open(self, final: bool, named: bool) -> bool:
        """A call object must start at ``pos`` (after whitespace)."""
        at = self._solid()
        if at >= len(self.text):
            if final:
                self._broken()
            return False
        if self.text[at] != "{":
            self._broken()
            return True
        name = self.name if named else None
        self.calls.append(_Call(ObjectScanner(at, self.fmt.ARGUMENT_KEYS, name)))
        self.pos = at
        self.state = "object"
        return True

    def _read_object(self) -> bool:
        scanner = self.calls[-1].scanner
        scanner.feed(self.text, len(self.text))
        if scanner.name is not None and not NAME_PATTERN.fullmatch(scanner.name):
            self.calls.pop()  # not a function's name: not a call
            self._broken()
            return True
        if scanner.bad and scanner.name is not None:  # named: kept as read
            if scanner.in_args:
                scanner.args_end = scanner.args_last
            scanner.bad = False
            scanner.end = scanner.pos
        elif scanner.bad or (scanner.end >= 0 and scanner.name is None):
            self.calls.pop()  # not a call
            self._broken()
            return True
        if scanner.end < 0:
            return False
        self.pos = scanner.end
        self.state = "after"
        self.after_call = True
        return True

    def _step_hermes(self, out: list[str], final: bool) -> bool:
        if self.state == "content":
            if not self._content_until(out, Hermes.OPEN, final):
                return False
            self.state = "open"
            return True
        at = self._solid()  # behind a call: its closing tag, then content again
        if self.text.startswith(Hermes.CLOSE, at):
            self.pos = at + len(Hermes.CLOSE)
        elif self._waiting_for(Hermes.CLOSE, at, final):
            return False
        self.state = "content"
        return True

    def _step_llama(self, final: bool) -> bool:
        at = self._solid()
        if self.state == "content":  # the output starts with a call, or is content
            if self.text.startswith(Llama3Json.TAG, at):
                self.broken_at = at
                self.pos = at + len(Llama3Json.TAG)
                self.state = "open"
            elif at < len(self.text) and self.text[at] == "{":
                self.broken_at = at
                self.state = "open"
            elif at >= len(self.text) or self._waiting_for(Llama3Json.TAG, at, final):
                return False
            else:
                self.state = "plain"
            return True
        if at >= len(self.text):  # behind a call: ';' and the next, or content
            return False
        if self.text[at] == ";":
            self.broken_at = at
            self.pos = at + 1
            self.state = "open"
        else:
            self.pos = at
            self.state = "plain"
        return True

    def _step_mistral(self, out: list[str], final: bool) -> bool:
        state = self.state
        if state == "start":  # [TOOL_CALLS] is a special token the text may lack
            at = self._solid()
            after = self.text[at + 1 : at + 64].lstrip(_WS)[:1]  # what follows a "["
            bracket = self.text.startswith("[", at)
            if not final and (at >= len(self.text) or (bracket and not after)):
                return False
            self.state = "content"
            if bracket and after == "{":
                self.broken_at = at
                self.pos = at + 1
                self.state = "in_list"
                self.guessed = True
            return True
        if state == "content":
            if not self._content_until(out, Mistral.OPEN, final):
                return False
            self.state = "list_or_name"
            return True
        if state == "name":
            cut = self.text.find(Mistral.ARGS, self.pos)
            if cut < 0:
                if final:
                    self._broken()
                return False
            self.name = self.text[self.pos : cut].strip()
            if not NAME_PATTERN.fullmatch(self.name):
                self._broken()
                return True
            self.pos = cut + len(Mistral.ARGS)
            self.state = "open_named"
            return True
        at = self._solid()
        if at >= len(self.text):
            return False
        if state == "list_or_name":
            self.pos = at + 1 if self.text[at] == "[" else at
            self.state = "in_list" if self.text[at] == "[" else "name"
            return True
        if state == "in_list":
            self.state = "open"
            return True
        listed = not self.calls[-1].scanner.whole  # behind a call
        if listed and self.text[at] in ",]":
            self.broken_at = at
            self.pos = at + 1
            self.state = "open" if self.text[at] == "," else "content"
            return True
        if not listed and self.text.startswith(Mistral.OPEN, at):
            self.broken_at = at
            self.pos = at + len(Mistral.OPEN)
            self.state = "name"
            return True
        if not listed and self._waiting_for(Mistral.OPEN, at, final):
            return False
        self.pos = at
        self.state = "content"
        return True

    def _deltas(self, final: bool) -> list[ToolCallDelta]:
        """What the calls still open added (calls that sent everything are skipped)."""
        deltas = []
        calls, text = self.calls, self.text
        for index in range(self.open_from, len(calls)):
            call = calls[index]
            scanner = call.scanner
            if scanner.name is None:
                continue
            name = None
            if not call.name_sent:
                call.name_sent = True
                name = scanner.name
            arguments = _arguments(text, scanner, call.sent, scanner.end >= 0 or final)
            call.sent += len(arguments)
            if name is not None or arguments:
                deltas.append(ToolCallDelta(index, name, arguments))
        while self.open_from < len(calls) and calls[self.open_from].scanner.end >= 0:
            self.open_from += 1  # a finished call sent its last part just now
        return deltas


def _arguments(text: str, scanner: ObjectScanner, sent: int, done: bool) -> str:
    """The call's arguments text read so far, from character ``sent`` (up to its last
    non-whitespace character); a finished call that gave none has ``{}``."""
    if scanner.args_start < 0:
        return "{}"[sent:] if done and scanner.end >= 0 else ""
    end = scanner.args_end if scanner.args_end >= 0 else scanner.args_last
    return text[scanner.args_start + sent : end]


def parse_tool_calls(fmt: ToolFormat | str, text: str) -> tuple[str, list[ParsedCall]]:
    """A whole output's (content, tool calls), in one pass of the reader that streams
    (so a stream's deltas join to exactly this)."""
    reader = ToolCallReader(tool_format(fmt) if isinstance(fmt, str) else fmt)
    content, _ = reader.feed(text, final=True)
    calls = [
        ParsedCall(c.scanner.name, _arguments(reader.text, c.scanner, 0, True))
        for c in reader.calls
        if c.scanner.name is not None
    ]
    return content, calls
