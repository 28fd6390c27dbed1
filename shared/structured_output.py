"""What a request's output must match: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar (vLLM's ``structured_outputs``
fields). The scheduler compiles it for the model's tokenizer and masks every token
that could not continue a match (``scheduler_svc/structured_output.py``)."""

from __future__ import annotations

from typing import Any

import msgspec

from shared.errors import InvalidRequestError

__all__ = ["MAX_CHOICES", "MAX_STRUCTURED_BYTES", "StructuredOutput"]

MAX_STRUCTURED_BYTES = 256 * 1024
"""Largest schema, regex, grammar or list of choices (UTF-8 bytes) one request may give."""
MAX_CHOICES = 1024

FIELD = "structured_outputs"
"""The field errors name (the gateway's forms all reach it)."""


class StructuredOutput(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Exactly one of the fields. Construction checks the shape and the size (the
    content is checked when the scheduler compiles it: a bad schema or grammar is a
    ``bad_request`` naming the problem)."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (an object, or its JSON text; stored as text)."""
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: Lark syntax, or llama.cpp's GBNF (EBNF)."""
    json_object: bool = False
    """Any JSON object."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between tokens (vLLM's option; default: runs of up to 24
    whitespace characters)."""

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object is True else [])
        for flag in ("json_object", "disable_any_whitespace"):
            if type(getattr(self, flag)) is not bool:
                _fail(f"{flag}: expected a boolean, got {getattr(self, flag)!r}")
        if len(given) != 1:
            _fail(
                "give exactly one of json, regex, choice, grammar and json_object, "
                f"got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, dict):
            msgspec.structs.force_setattr(self, "json", msgspec.json.encode(self.json).decode())
        if self.choice is not None:
            if not isinstance(self.choice, tuple):
                msgspec.structs.force_setattr(self, "choice", tuple(self.choice))
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                _fail(f"choice: between 1 and {MAX_CHOICES} strings, got {len(self.choice)}")
            if not all(isinstance(c, str) and c for c in self.choice):
                _fail("choice: every choice must be a non-empty string")
        size = len(self.source().encode("utf-8", "surrogatepass"))
        if size > MAX_STRUCTURED_BYTES:
            _fail(
                f"{given[0]}: {size} bytes; at most {MAX_STRUCTURED_BYTES} bytes of schema, "
                "regex, grammar or choices"
            )

    @property
    def kind(self) -> str:
        """``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def source(self) -> str:
        """The constraint as text: the schema, regex or grammar; choices as a JSON list."""
        if self.choice is not None:
            return msgspec.json.encode(list(self.choice)).decode()
        if self.json_object:
            return '{"type": "object"}'
        return str(self.json if self.json is not None else (self.regex or self.grammar or ""))


def _fail(message: str) -> None:
    raise InvalidRequestError(f"{FIELD}: {message}", field=FIELD)
