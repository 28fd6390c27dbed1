"""One JSON object read as its text arrives (a tool call's object): where it ends, its
top-level ``name`` string, and where the value of its arguments key starts and ends, so
the arguments can be sent while they are generated. Strings and escapes are followed;
nesting is counted, not validated (the whole object is JSON when the model kept to the
format; when it did not, the reader says so as soon as the shape breaks)."""

from __future__ import annotations

import json

__all__ = ["WHITESPACE", "ObjectScanner"]

WHITESPACE = " \t\r\n"
"""JSON's whitespace."""
_WS = WHITESPACE


class ObjectScanner:
    """Reads one JSON object incrementally: where it ends, its top-level ``name``
    string and where the value of its arguments key starts and ends."""

    def __init__(self, start: int, argument_keys: tuple[str, ...], name: str | None = None) -> None:
        self.whole = name is not None
        """Mistral v11: the name came before the object, which is the arguments."""
        self.pos = start + 1
        self.depth = 1
        self.in_string = False
        self.escape = False
        self.argument_keys = argument_keys
        self.expect_key = True
        self.key_start = -1
        self.key: str | None = None
        self.value_start = -1
        """Where the current top-level value starts (-1: not yet, or between values)."""
        self.string_value_start = -1
        self.name = name
        self.args_start = start if self.whole else -1
        self.args_end = -1
        self.args_last = start + 1 if self.whole else -1
        """One past the last non-whitespace character of the arguments seen so far."""
        self.end = -1
        """One past the closing brace, once read."""
        self.bad = False

    @property
    def in_args(self) -> bool:
        return self.args_start >= 0 and self.args_end < 0

    def feed(self, text: str, upto: int) -> None:
        """Read ``text[self.pos:upto]``; stops at the object's end or at a fault."""
        pos = self.pos
        while pos < upto and self.end < 0 and not self.bad:
            ch = text[pos]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    self._string_closed(text, pos)
            elif ch in _WS:
                pass
            elif ch == '"':
                self.in_string = True
                if self.depth == 1:
                    if self.expect_key:
                        self.key_start = pos
                    elif self.value_start < 0:
                        self._value_begins(pos)
                        self.string_value_start = pos
            elif ch in "{[":
                if self.depth == 1 and self.value_start < 0:
                    if self.expect_key:
                        self.bad = True
                        break
                    self._value_begins(pos)
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    if ch != "}":
                        self.bad = True
                        break
                    self._value_ends()
                    self.end = pos + 1
                    if self.whole:
                        self.args_end = self.end
            elif self.depth == 1:
                if ch == ":" and self.key is not None and self.value_start < 0:
                    self.expect_key = False
                elif ch == ",":
                    self._value_ends()
                    self.expect_key = True
                    self.key = None
                elif self.value_start < 0 and not self.expect_key:
                    self._value_begins(pos)  # a number, true, false or null
                elif self.value_start < 0:
                    self.bad = True
                    break
            if self.in_args and ch not in _WS:
                self.args_last = pos + 1
            pos += 1
        self.pos = pos

    def _value_begins(self, pos: int) -> None:
        self.value_start = pos
        if self.key in self.argument_keys and self.args_start < 0:
            self.args_start = pos

    def _value_ends(self) -> None:
        if self.in_args and self.value_start == self.args_start:
            self.args_end = self.args_last
        self.value_start = -1

    def _string_closed(self, text: str, pos: int) -> None:
        if self.depth != 1:
            return
        if self.key_start >= 0:
            self.key = _loads_str(text[self.key_start : pos + 1])
            self.key_start = -1
        elif self.string_value_start >= 0:
            if self.key == "name" and self.name is None:
                self.name = _loads_str(text[self.string_value_start : pos + 1])
            self.string_value_start = -1


def _loads_str(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
