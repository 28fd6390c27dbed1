"""Settings declared once; loading, checking, env vars, flags and TOML derive from that.

A settings table is a :class:`Settings` subclass naming its TOML table in ``TABLE`` and
declaring each field once, as in::

    max_num_seqs: Annotated[int, Meta(ge=1, description="Most requests ...")] = 256

The type (``bool``, ``int``, ``float``, ``str`` or a ``Literal`` of strings; ``| None``
outside the ``Annotated`` makes it optional), the default, the bounds (``ge``, ``gt``,
``le``, ``lt``), an optional extra :class:`Check` and the help text (``description``)
are all there is to say about a field. From them come

* validation on construction and on msgspec decoding: a wrong type or an out-of-range
  value raises :class:`ConfigError` naming the field (float fields must be finite, and
  an integer given for one is stored as a float);
* :func:`load_settings`: the ``[TABLE]`` of a TOML file (unknown keys refused with a
  did-you-mean), ``EXPEDITOR_<FIELD>`` environment variables parsed by the declared
  type, and flag values, layered flags > env > file > defaults, each bad value reported
  with the layer it came from;
* the ``--field-name`` flags and their help (``expeditor/cli_options.py``);
* :func:`settings_to_toml`, which writes each value under its help as a comment.

Rules that tie fields together stay in the subclass's ``__post_init__``, after
``super().__post_init__()``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tomllib
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    NoReturn,
    TypeVar,
    Union,
    get_args,
    get_origin,
)

import msgspec
from msgspec.structs import force_setattr

from shared.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "Check",
    "FieldSpec",
    "Settings",
    "env_var_name",
    "field_spec",
    "field_specs",
    "flag_name",
    "help_texts",
    "load_settings",
    "settings_to_toml",
]

ENV_PREFIX = "EXPEDITOR_"

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_UNSUPPORTED_META = ("multiple_of", "pattern", "min_length", "max_length", "tz")


def env_var_name(name: str) -> str:
    """The environment variable that sets field ``name``: ``EXPEDITOR_<NAME>``."""
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    """The CLI flag that sets field ``name``: ``--<name-with-dashes>``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Check:
    """A rule beyond a field's bounds: ``test(value)`` must hold. ``requirement`` ends
    "must be ..." in the error and replaces the bounds' own wording there."""

    test: Callable[[Any], bool]
    requirement: str


@dataclass(frozen=True)
class FieldSpec:
    """What one field's declaration says, read off the struct."""

    name: str
    value_type: Any  # bool, int, float, str or Literal[...], without None
    optional: bool
    default: object
    help: str
    bounds: msgspec.Meta
    check: Check | None

    @property
    def kind(self) -> type:
        """``bool``, ``int``, ``float`` or ``str`` (for a ``Literal`` too)."""
        return str if get_origin(self.value_type) is Literal else self.value_type

    @property
    def env_var(self) -> str:
        return env_var_name(self.name)

    def validate(self, value: object) -> object:
        """``value`` if it is of the declared type and meets the constraints (an int
        for a float field comes back as a float); else :class:`ConfigError`."""
        if value is None and self.optional:
            return None
        kind = self.kind
        if get_origin(self.value_type) is Literal:
            if not isinstance(value, str) or value not in get_args(self.value_type):
                listed = ", ".join(repr(choice) for choice in get_args(self.value_type))
                self._fail(f"must be one of {listed}, got {value!r}")
        elif kind is float:
            if type(value) is not float and type(value) is not int:
                self._fail(f"expected a number, got {value!r}")
            value = float(value)  # type: ignore[arg-type]  # an int or a float here
            if not math.isfinite(value):
                self._fail(f"must be a finite number, got {value!r}")
        elif type(value) is not kind:  # bool is an int subclass: refused for int too
            expected = {bool: "a boolean", int: "an integer", str: "a string"}[kind]
            self._fail(f"expected {expected}, got {value!r}")
        if not self._meets_constraints(value):
            self._fail(f"must be {self._requirement()}, got {value!r}")
        return value

    def parse_env(self, raw: str) -> object:
        """The value an environment variable's text stands for; only the syntax is
        checked here, the rest by :meth:`validate`."""
        text = raw.strip()
        if self.kind is bool:
            word = text.lower()
            if word in _TRUE_WORDS or word in _FALSE_WORDS:
                return word in _TRUE_WORDS
            self._fail(f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")
        if self.kind is str:
            return text if get_origin(self.value_type) is Literal else raw
        if self.optional and text.lower() in ("", "none"):
            return None
        try:
            return int(text, 10) if self.kind is int else float(text)
        except ValueError:
            expected = "an integer" if self.kind is int else "a number"
            if self.optional:
                expected += " or 'none'"
            self._fail(f"expected {expected}, got {raw!r}")

    def _meets_constraints(self, value: Any) -> bool:
        meta = self.bounds
        outside = (
            (meta.ge is not None and value < meta.ge)
            or (meta.gt is not None and value <= meta.gt)
            or (meta.le is not None and value > meta.le)
            or (meta.lt is not None and value >= meta.lt)
        )
        return not outside and (self.check is None or self.check.test(value))

    def _requirement(self) -> str:
        if self.check is not None:
            return self.check.requirement
        meta = self.bounds
        if self.kind is int and meta.le is None and meta.lt is None:
            if meta.ge == 0:
                return "a non-negative integer"
            if meta.ge == 1 or meta.gt == 0:
                return "a positive integer"
        low = meta.ge if meta.ge is not None else meta.gt
        high = meta.le if meta.le is not None else meta.lt
        if low is not None and high is not None:
            opening = "[" if meta.ge is not None else "("
            closing = "]" if meta.le is not None else ")"
            interval = f"in {opening}{low:g}, {high:g}{closing}"
        elif low is not None:
            interval = f"{'>=' if meta.ge is not None else '>'} {low:g}"
        else:
            interval = f"{'<=' if meta.le is not None else '<'} {high:g}"
        return ("an integer " if self.kind is int else "") + interval

    def _fail(self, problem: str) -> NoReturn:
        raise ConfigError(f"{self.name}: {problem}", field=self.name)


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of a settings table; see the module docstring for how fields are declared."""

    TABLE: ClassVar[str]
    """The TOML table holding these settings."""

    def __post_init__(self) -> None:
        for spec in field_specs(type(self)).values():
            value = getattr(self, spec.name)
            checked = spec.validate(value)
            if checked is not value:
                force_setattr(self, spec.name, checked)


_SettingsT = TypeVar("_SettingsT", bound=Settings)


def _read_spec(info: msgspec.structs.FieldInfo) -> FieldSpec:
    declared, optional = info.type, False
    if get_origin(declared) in (Union, types.UnionType):
        members = [member for member in get_args(declared) if member is not type(None)]
        if len(members) != 1:
            raise TypeError(f"{info.name}: only `Annotated[...] | None` unions are supported")
        declared, optional = members[0], True
    if get_origin(declared) is not Annotated:
        raise TypeError(f"{info.name}: declare as Annotated[T, msgspec.Meta(description=...)]")
    value_type, *extras = get_args(declared)
    metas = [extra for extra in extras if isinstance(extra, msgspec.Meta)]
    checks = [extra for extra in extras if isinstance(extra, Check)]
    if len(metas) != 1 or not metas[0].description or len(checks) > 1:
        raise TypeError(f"{info.name}: needs one msgspec.Meta with a description, <= 1 Check")
    if any(getattr(metas[0], attr) is not None for attr in _UNSUPPORTED_META):
        raise TypeError(f"{info.name}: only ge, gt, le and lt bounds are supported")
    literal = get_origin(value_type) is Literal
    if not (value_type in (bool, int, float, str) or literal):
        raise TypeError(f"{info.name}: unsupported type {value_type!r}")
    if literal and not all(isinstance(choice, str) for choice in get_args(value_type)):
        raise TypeError(f"{info.name}: Literal choices must be strings")
    return FieldSpec(
        name=info.name,
        value_type=value_type,
        optional=optional,
        default=info.default,
        help=metas[0].description,
        bounds=metas[0],
        check=checks[0] if checks else None,
    )


@cache
def field_specs(cls: type[Settings]) -> dict[str, FieldSpec]:
    """Every field of ``cls`` in declaration order, by name."""
    return {info.name: _read_spec(info) for info in msgspec.structs.fields(cls)}


def _unknown_field(
    cls: type[Settings], name: str, head: str, *, source: str | None = None
) -> ConfigError:
    """An error for a key that is not a field: ``head``, a suggestion, the valid keys."""
    names = list(field_specs(cls))
    message = head
    close = difflib.get_close_matches(name, names, n=1)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    message += "; valid keys: " + ", ".join(names)
    return ConfigError(message, field=name, source=source)


def field_spec(cls: type[Settings], name: str) -> FieldSpec:
    """The declaration of field ``name`` of ``cls``; :class:`ConfigError` if none."""
    try:
        return field_specs(cls)[name]
    except KeyError:
        raise _unknown_field(cls, name, f"unknown [{cls.TABLE}] field {name!r}") from None


def help_texts(cls: type[Settings]) -> dict[str, str]:
    """Each field's help text, by name."""
    return {name: spec.help for name, spec in field_specs(cls).items()}


@contextmanager
def _from(source: str) -> Iterator[None]:
    """Add ``source`` (the layer a value came from) to a :class:`ConfigError`."""
    try:
        yield
    except ConfigError as error:
        raise ConfigError(f"{error} (from {source})", field=error.field, source=source) from None


def _read_table(cls: type[Settings], path: str | os.PathLike[str]) -> dict[str, object]:
    shown = os.fspath(path)
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {shown}", source=shown) from None
    except OSError as error:
        raise ConfigError(
            f"cannot read config file {shown}: {error.strerror or error}", source=shown
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{shown}: invalid TOML: {error}", source=shown) from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{shown}: not valid UTF-8: {error}", source=shown) from None

    table = document.get(cls.TABLE, {})
    if not isinstance(table, dict):
        raise ConfigError(
            f"{shown}: [{cls.TABLE}] must be a table, got {type(table).__name__}", source=shown
        )
    specs = field_specs(cls)
    source = f"{shown} [{cls.TABLE}]"
    values: dict[str, object] = {}
    for key, value in table.items():
        if key not in specs:
            raise _unknown_field(
                cls, key, f"{shown}: unknown key {key!r} in [{cls.TABLE}]", source=shown
            )
        with _from(source):
            values[key] = specs[key].validate(value)
    return values


def load_settings(
    cls: type[_SettingsT],
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> _SettingsT:
    """Build ``cls`` from its TOML table in ``path``, the environment and flag values.

    ``env=None`` reads ``os.environ``; variables that name no field of ``cls`` are
    ignored (they belong to other tables). ``overrides`` maps field names to typed
    values as a CLI parser produces them; ``None`` means "not given", so an unset flag
    never masks a lower layer. Raises :class:`ConfigError` naming the field and its
    source on any bad value, unknown key or unreadable file; a rule tying fields
    together is reported prefixed with ``[TABLE]``.
    """
    specs = field_specs(cls)
    values: dict[str, object] = {}
    if path is not None:
        values.update(_read_table(cls, path))

    environment = os.environ if env is None else env
    for name, spec in specs.items():
        raw = environment.get(spec.env_var)
        if raw is not None:
            source = f"environment variable {spec.env_var}"
            with _from(source):
                values[name] = spec.validate(spec.parse_env(raw))

    for name, value in (overrides or {}).items():
        if name not in specs:
            raise _unknown_field(cls, name, f"unknown override {name!r}")
        if value is not None:
            with _from(f"flag {flag_name(name)}"):
                values[name] = specs[name].validate(value)

    try:
        return cls(**values)
    except ConfigError as error:
        raise ConfigError(
            f"[{cls.TABLE}] {error}", field=error.field, source=error.source
        ) from None


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # finite by validation; repr() is valid TOML for both
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def settings_to_toml(settings: Settings) -> str:
    """``settings`` as its TOML table, each value under its help as a comment.

    ``None`` values are left out (TOML has no null); :func:`load_settings` reads the
    result back to equal settings.
    """
    lines = [f"[{settings.TABLE}]"]
    for name, spec in field_specs(type(settings)).items():
        value = getattr(settings, name)
        if value is not None:
            lines += [f"# {spec.help}", f"{name} = {_toml_value(value)}"]
    return "\n".join(lines) + "\n"
