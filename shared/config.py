"""Scheduler configuration: one validated, frozen struct and its loader.

Values come from four layers, highest precedence first:

1. ``overrides`` (CLI flags; keys are field names, ``None`` values mean "not given"),
2. ``EXPEDITOR_<FIELD_UPPER>`` environment variables,
3. the ``[scheduler]`` table of a TOML file,
4. the defaults declared on :class:`SchedulerConfig`.

Every value is checked where it enters, so an error names both the field and the
layer it came from. Other top-level TOML tables (``[server]``, ``[worker]``, ...) and
``EXPEDITOR_*`` variables that do not name a scheduler field belong to other
components and are ignored here.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tomllib
import types
from collections.abc import Callable, Mapping
from functools import cache
from typing import Literal, get_args, get_origin

import msgspec
from msgspec.structs import force_setattr

from shared.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "FIELD_HELP",
    "SCHEDULER_FIELDS",
    "SchedulerConfig",
    "config_to_toml",
    "env_var_name",
    "field_type",
    "flag_name",
    "load_config",
]

ENV_PREFIX = "EXPEDITOR_"
TOML_TABLE = "scheduler"

PreemptionMode = Literal["auto", "swap", "recompute"]
QueuePolicy = Literal["fcfs", "priority"]


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Knobs of the scheduler daemon; see ``FIELD_HELP`` for one line on each.

    Direct construction validates too: a wrong type or out-of-range value raises
    :class:`ConfigError` naming the field. Integer values given for float fields are
    stored as floats.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    watermark: float = 0.01
    preemption_mode: PreemptionMode = "auto"
    policy: QueuePolicy = "fcfs"
    aging_rate: float = 0.01
    fair_share: bool = True
    max_preemptions: int = 8
    max_waiting_requests: int = 4096
    enable_prefix_caching: bool = True
    swap_bandwidth_gbps: float = 16.0
    prefill_tokens_per_s: float = 20000.0
    swap_overhead_ms: float = 0.5

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            checked = _VALIDATORS[name](name, value)
            if checked is not value:
                force_setattr(self, name, checked)

    def watermark_blocks(self, num_gpu_blocks: int) -> int:
        """GPU blocks held back from admission out of a pool of ``num_gpu_blocks``."""
        return int(self.watermark * num_gpu_blocks)


SCHEDULER_FIELDS: tuple[str, ...] = SchedulerConfig.__struct_fields__

FIELD_HELP: dict[str, str] = {
    "block_size": "Tokens per KV cache block (power of two, 1..256).",
    "num_gpu_blocks": "KV blocks per GPU worker; unset = sized from the workers' hello.",
    "num_cpu_blocks": "Blocks in the CPU swap pool (pinned shared memory); 0 = no swap.",
    "max_num_seqs": "Most requests running in one step.",
    "max_num_batched_tokens": "Token budget of one forward step (prefill chunks + decodes).",
    "max_model_len": "Longest context (prompt + generated tokens) a request may reach.",
    "long_prefill_token_threshold": "Cap on one request's prefill chunk per step; 0 = off.",
    "watermark": "Fraction of GPU blocks held back from admission (0 <= w < 1).",
    "preemption_mode": "How victims give up KV: auto (cost model), swap or recompute.",
    "policy": "Waiting-queue order: fcfs, or priority (FIFO within a priority, with aging).",
    "aging_rate": "Priority units a waiting request gains per step waited.",
    "fair_share": "Round-robin admission among clients at equal priority; off = strict "
    "arrival order.",
    "max_preemptions": "Preemptions after which a request is no longer picked as a victim "
    "while others can be.",
    "max_waiting_requests": "Waiting-queue length beyond which requests are refused as overloaded.",
    "enable_prefix_caching": "Share KV blocks of identical prompt prefixes across requests.",
    "swap_bandwidth_gbps": "Host<->device copy bandwidth (GB/s) assumed by the swap cost model.",
    "prefill_tokens_per_s": "Prefill throughput (tokens/s) assumed by the recompute cost model.",
    "swap_overhead_ms": "Fixed cost (ms) of one swap-out/swap-in round trip in the cost model.",
}


# --------------------------------------------------------------------------- validation

_Validator = Callable[[str, object], object]


def _require_int(name: str, value: object) -> int:
    if type(value) is not int:  # bool is an int subclass: reject it too
        raise ConfigError(f"{name}: expected an integer, got {value!r}", field=name)
    return value


def _require_float(name: str, value: object) -> float:
    if type(value) is not float and type(value) is not int:
        raise ConfigError(f"{name}: expected a number, got {value!r}", field=name)
    result = float(value)
    if not math.isfinite(result):
        raise ConfigError(f"{name}: must be a finite number, got {value!r}", field=name)
    return result


def _int_at_least(minimum: int) -> _Validator:
    wording = {0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}"
    )

    def check(name: str, value: object) -> int:
        number = _require_int(name, value)
        if number < minimum:
            raise ConfigError(f"{name}: must be {wording}, got {number!r}", field=name)
        return number

    return check


def _optional(inner: _Validator) -> _Validator:
    def check(name: str, value: object) -> object:
        return None if value is None else inner(name, value)

    return check


def _power_of_two_up_to(maximum: int) -> _Validator:
    def check(name: str, value: object) -> int:
        number = _require_int(name, value)
        if not 1 <= number <= maximum or number & (number - 1):
            raise ConfigError(
                f"{name}: must be a power of two between 1 and {maximum}, got {number!r}",
                field=name,
            )
        return number

    return check


def _float_in(*, low: float, low_inclusive: bool, high: float | None = None) -> _Validator:
    """A finite float in ``[low, high)`` (or ``(low, high)``); ``high=None`` = unbounded."""
    if high is None:
        requirement = f"{'>=' if low_inclusive else '>'} {low:g}"
    else:
        requirement = f"in {'[' if low_inclusive else '('}{low:g}, {high:g})"

    def check(name: str, value: object) -> float:
        number = _require_float(name, value)
        above_low = number >= low if low_inclusive else number > low
        if not above_low or (high is not None and number >= high):
            raise ConfigError(f"{name}: must be {requirement}, got {number!r}", field=name)
        return number

    return check


def _one_of(choices: tuple[str, ...]) -> _Validator:
    def check(name: str, value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            listed = ", ".join(repr(choice) for choice in choices)
            raise ConfigError(f"{name}: must be one of {listed}, got {value!r}", field=name)
        return value

    return check


def _boolean(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise ConfigError(f"{name}: expected a boolean, got {value!r}", field=name)
    return value


_VALIDATORS: dict[str, _Validator] = {
    "block_size": _power_of_two_up_to(256),
    "num_gpu_blocks": _optional(_int_at_least(1)),
    "num_cpu_blocks": _int_at_least(0),
    "max_num_seqs": _int_at_least(1),
    "max_num_batched_tokens": _int_at_least(1),
    "max_model_len": _int_at_least(2),
    "long_prefill_token_threshold": _int_at_least(0),
    "watermark": _float_in(low=0.0, low_inclusive=True, high=1.0),
    "preemption_mode": _one_of(get_args(PreemptionMode)),
    "policy": _one_of(get_args(QueuePolicy)),
    "aging_rate": _float_in(low=0.0, low_inclusive=True),
    "fair_share": _boolean,
    "max_preemptions": _int_at_least(1),
    "max_waiting_requests": _int_at_least(1),
    "enable_prefix_caching": _boolean,
    "swap_bandwidth_gbps": _float_in(low=0.0, low_inclusive=False),
    "prefill_tokens_per_s": _float_in(low=0.0, low_inclusive=False),
    "swap_overhead_ms": _float_in(low=0.0, low_inclusive=True),
}


# --------------------------------------------------------------------------- field metadata


def _unknown_field(name: str, head: str, *, source: str | None = None) -> ConfigError:
    """An error for a key that is not a scheduler field: ``head``, a suggestion, the
    valid keys."""
    message = head
    close = difflib.get_close_matches(name, SCHEDULER_FIELDS, n=1)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    message += "; valid keys: " + ", ".join(SCHEDULER_FIELDS)
    return ConfigError(message, field=name, source=source)


@cache
def _field_types() -> dict[str, object]:
    return {info.name: info.type for info in msgspec.structs.fields(SchedulerConfig)}


def field_type(name: str) -> object:
    """The declared type of a scheduler field: ``int``, ``int | None``, ``float``,
    ``bool`` or a ``Literal[...]`` of strings."""
    try:
        return _field_types()[name]
    except KeyError:
        raise _unknown_field(name, f"unknown scheduler field {name!r}") from None


def env_var_name(name: str) -> str:
    """The environment variable that sets field ``name``: ``EXPEDITOR_<NAME>``."""
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    """The CLI flag that sets field ``name``: ``--<name-with-dashes>``."""
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------- loading

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def _parse_env_value(name: str, raw: str) -> object:
    """Turn the text of an environment variable into a value of ``name``'s type.

    Only the syntax is checked here; ranges are left to the field validators.
    """
    hint = field_type(name)
    text = raw.strip()
    if hint is bool:
        word = text.lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise ConfigError(
            f"{name}: expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}",
            field=name,
        )
    if get_origin(hint) is Literal:
        return text
    members = get_args(hint) if get_origin(hint) is types.UnionType else (hint,)
    optional = type(None) in members
    if optional and text.lower() in ("", "none"):
        return None
    if int in members:
        try:
            return int(text, 10)
        except ValueError:
            expected = "an integer or 'none'" if optional else "an integer"
            raise ConfigError(f"{name}: expected {expected}, got {raw!r}", field=name) from None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name}: expected a number, got {raw!r}", field=name) from None


def _checked(name: str, value: object, source: str) -> object:
    """Validate one value of field ``name`` and name ``source`` in any error."""
    try:
        return _VALIDATORS[name](name, value)
    except ConfigError as error:
        raise ConfigError(f"{error} (from {source})", field=name, source=source) from None


def _read_toml_table(path: str | os.PathLike[str]) -> dict[str, object]:
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

    table = document.get(TOML_TABLE, {})
    if not isinstance(table, dict):
        raise ConfigError(
            f"{shown}: [{TOML_TABLE}] must be a table, got {type(table).__name__}",
            source=shown,
        )
    source = f"{shown} [{TOML_TABLE}]"
    values: dict[str, object] = {}
    for key, value in table.items():
        if key not in _VALIDATORS:
            raise _unknown_field(
                key, f"{shown}: unknown key {key!r} in [{TOML_TABLE}]", source=shown
            )
        values[key] = _checked(key, value, source)
    return values


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> SchedulerConfig:
    """Build the scheduler configuration from file, environment and CLI overrides.

    ``env=None`` reads ``os.environ``. ``overrides`` maps field names to already
    typed values (as a CLI parser produces them); entries whose value is ``None`` are
    skipped, so an unset flag never masks a lower layer. Raises :class:`ConfigError`
    naming the field and its source on any bad value, unknown key or unreadable file.
    """
    values: dict[str, object] = {}
    if path is not None:
        values.update(_read_toml_table(path))

    environment = os.environ if env is None else env
    for name in SCHEDULER_FIELDS:
        variable = env_var_name(name)
        raw = environment.get(variable)
        if raw is not None:
            source = f"environment variable {variable}"
            try:
                parsed = _parse_env_value(name, raw)
            except ConfigError as error:
                raise ConfigError(f"{error} (from {source})", field=name, source=source) from None
            values[name] = _checked(name, parsed, source)

    for name, value in (overrides or {}).items():
        if name not in _VALIDATORS:
            raise _unknown_field(name, f"unknown override {name!r}")
        if value is not None:
            values[name] = _checked(name, value, f"flag {flag_name(name)}")

    return SchedulerConfig(**values)  # type: ignore[arg-type]  # values were checked above


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # finite by validation; repr() is valid TOML for both
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def config_to_toml(cfg: SchedulerConfig) -> str:
    """Render ``cfg`` as a ``[scheduler]`` TOML table, one commented line per field.

    ``None`` values are omitted (TOML has no null); ``load_config`` reads the result
    back to an equal config.
    """
    lines = [f"[{TOML_TABLE}]"]
    for name in SCHEDULER_FIELDS:
        value = getattr(cfg, name)
        if value is None:
            continue
        lines.append(f"# {FIELD_HELP[name]}")
        lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
