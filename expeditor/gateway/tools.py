"""A chat request's ``tools`` and ``tool_choice``, checked, and what they ask of the
engine and of the response.

- ``none``: the tools go to the chat template, the output is plain content;
- ``auto`` (the default with tools): the output is read for calls in the server's
  ``tool_call_parser`` format (:mod:`expeditor.gateway.tool_parsers`);
- ``required``: one or more calls (exactly one with ``parallel_tool_calls: false``),
  enforced by a grammar of that format whose arguments follow each tool's JSON schema;
- ``{"type": "function", "function": {"name": N}}``: exactly one call of ``N``, enforced
  the same way.

A response whose message carries calls ends with ``finish_reason: tool_calls`` (unless
it ran out of tokens: ``length``). ``parallel_tool_calls: false`` keeps an ``auto``
answer's first call only.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from expeditor.gateway.protocol import GatewayRequestError
from expeditor.gateway.tool_parsers import NAME_PATTERN, ParsedCall, ToolFormat, tool_format

__all__ = ["ToolPlan", "call_id", "plan_tools", "tool_call_body"]

WHITESPACE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}
"""Forced arguments: JSON whitespace in runs of at most 24 characters (as
``structured_outputs`` JSON; unbounded, a small model can emit newlines to the end)."""


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tools ask for."""

    tools: list[dict[str, Any]]
    """As given (``{"type": "function", "function": {...}}``): the chat template's."""
    choice: str
    """none | auto | required | named."""
    named: str | None
    parallel: bool
    format: ToolFormat | None
    """The server's tool-call format (None: the server reads no calls)."""

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read for calls (every choice but none)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def grammar(self) -> str:
        """The Lark grammar of the calls ``required`` or a named choice allow."""
        assert self.format is not None and self.forced
        functions = [t["function"] for t in self.tools]
        if self.named is not None:
            functions = [f for f in functions if f["name"] == self.named]
        schemas = [
            {"name": f["name"], "parameters": _bounded(f.get("parameters") or {"type": "object"})}
            for f in functions
        ]
        return self.format.grammar(schemas, multiple=self.choice == "required" and self.parallel)

    def keeps(self, index: int) -> bool:
        """Whether a response carries call ``index`` (the first only without parallel
        calls)."""
        return self.parallel or index == 0


def _bounded(schema: dict[str, Any]) -> dict[str, Any]:
    guidance = {**WHITESPACE, **(schema.get("x-guidance") or {})}
    return {**schema, "x-guidance": guidance}


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel: Any, parser: str
) -> ToolPlan | None:
    """The checked plan (None: no tools, no choice); a 400 naming the field for a
    malformed tool, an unknown or unusable choice."""
    if parallel is not None and not isinstance(parallel, bool):
        raise GatewayRequestError(
            "parallel_tool_calls: expected a boolean", param="parallel_tool_calls"
        )
    if not tools:
        if tools is not None and tool_choice is None:
            raise GatewayRequestError("tools: must not be empty (leave it out)", param="tools")
        if tool_choice not in (None, "none"):
            raise GatewayRequestError(
                f"tool_choice: {_shown(tool_choice)} needs tools", param="tool_choice"
            )
        return None
    names = [_check_tool(index, tool) for index, tool in enumerate(tools)]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise GatewayRequestError(
                f"tools[{index}].function.name: {name!r} is given twice", param="tools"
            )
    choice, named = _choice(tool_choice, names)
    fmt = tool_format(parser) if parser not in ("", "none") else None
    if fmt is None and choice != "none":
        raise GatewayRequestError(
            f"tool_choice: {choice} needs a tool call parser on this server "
            "(gateway setting tool_call_parser)",
            param="tool_choice",
        )
    return ToolPlan(tools, choice, named, parallel is not False, fmt)


def _check_tool(index: int, tool: Any) -> str:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise GatewayRequestError(
            f'{where}: expected {{"type": "function", "function": {{...}}}}', param="tools"
        )
    unknown = set(tool) - {"type", "function"}
    function = tool.get("function")
    if unknown or not isinstance(function, dict):
        raise GatewayRequestError(
            f"{where}: expected type and function only"
            + (f", got {', '.join(sorted(unknown))}" if unknown else ""),
            param="tools",
        )
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise GatewayRequestError(
            f"{where}.function.name: 1 to 64 letters, digits, _ or -, got {name!r}",
            param="tools",
        )
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
        raise GatewayRequestError(
            f"{where}.function: unknown field {sorted(extra)[0]!r}", param="tools"
        )
    if not isinstance(function.get("description", ""), str):
        raise GatewayRequestError(f"{where}.function.description: expected a string", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise GatewayRequestError(
            f"{where}.function.parameters: expected a JSON schema object", param="tools"
        )
    if not isinstance((parameters or {}).get("x-guidance", {}), dict):
        raise GatewayRequestError(
            f"{where}.function.parameters: x-guidance must be an object", param="tools"
        )
    if function.get("strict") not in (None, True, False):
        raise GatewayRequestError(f"{where}.function.strict: expected a boolean", param="tools")
    return name


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto", "required"):
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise GatewayRequestError(
            'tool_choice: expected none, auto, required or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {_shown(value)}',
            param="tool_choice",
        )
    extra = sorted({*value} - {"type", "function"}) + sorted({*function} - {"name"})
    if extra:
        raise GatewayRequestError(
            f"tool_choice: unknown field {extra[0]!r} (a named choice is "
            '{"type": "function", "function": {"name": ...}})',
            param="tool_choice",
        )
    if name not in names:
        raise GatewayRequestError(
            f"tool_choice: no tool named {name!r} in tools", param="tool_choice"
        )
    return "named", name


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_body(call: ParsedCall, call_identifier: str) -> dict[str, Any]:
    """One ``message.tool_calls`` entry."""
    return {
        "id": call_identifier,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
