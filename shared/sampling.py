"""Per-request sampling parameters, shared by clients, the scheduler and the workers."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import NoReturn

import msgspec
from msgspec.structs import force_setattr

from shared.errors import InvalidRequestError

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "SamplingParams",
]

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
"""Longest stop string: the detokenizer holds back up to this much streamed text."""
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids one request may give (every sample carries the request's set;
the min-tokens mask holds them)."""
MAX_SEED = 2**63 - 1


class SamplingParams(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """How to pick the tokens of one request.

    Construction validates every field and raises :class:`InvalidRequestError` naming
    the first bad one; integers given for float fields are stored as floats and lists
    given for the tuple fields are stored as tuples. Use :meth:`from_dict` for
    untrusted input.
    """

    max_tokens: int | None = 16
    """Tokens to generate at most; ``None`` = until ``max_model_len``."""
    min_tokens: int = 0
    """Tokens to generate before EOS, stop token ids or stop strings may end the request."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    seed: int | None = None
    """Per-request RNG seed, in [0, 2**63); a seeded request samples the same tokens
    whatever it is batched with."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request (the stop token is kept in the output)."""
    stop: tuple[str, ...] = ()
    """Strings that end the request when they appear in the output text."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    n: int = 1
    """Parallel samples of the same prompt (they share the prompt's KV blocks)."""
    logprobs: int | None = None
    """Top logprobs to return per token besides the sampled one; ``None`` = off."""

    def __post_init__(self) -> None:
        max_tokens = _optional_int(self.max_tokens, "max_tokens", low=1)
        min_tokens = _int(self.min_tokens, "min_tokens", low=0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens: must be <= max_tokens ({max_tokens}), got {min_tokens}",
                field="min_tokens",
            )
        self._store("temperature", _float(self.temperature, "temperature"))
        if self.temperature < 0:
            _fail("temperature", "must be >= 0", self.temperature)
        self._store("top_p", _float(self.top_p, "top_p"))
        if not 0 < self.top_p <= 1:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        _int(self.top_k, "top_k", low=0)
        _optional_int(self.seed, "seed", low=0, high=MAX_SEED)
        self._store("stop_token_ids", _token_ids(self.stop_token_ids))
        self._store("stop", _stop_strings(self.stop))
        if type(self.ignore_eos) is not bool:
            _fail("ignore_eos", "expected a boolean", self.ignore_eos)
        _int(self.n, "n", low=1, high=MAX_N)
        _optional_int(self.logprobs, "logprobs", low=0, high=MAX_LOGPROBS)

    def _store(self, name: str, value: object) -> None:
        if value is not getattr(self, name):
            force_setattr(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SamplingParams:
        """Validate untrusted data (e.g. a decoded request) into ``SamplingParams``.

        Type errors, unknown fields and bad values all raise
        :class:`InvalidRequestError` whose message (and ``field``) names the field.
        """
        if not isinstance(d, Mapping):
            raise InvalidRequestError(
                f"sampling params: expected an object, got {type(d).__name__}"
            )
        try:
            return msgspec.convert(dict(d), cls)
        except msgspec.ValidationError as error:
            if isinstance(error.__cause__, InvalidRequestError):
                raise error.__cause__ from None
            raise _translate(error) from None


def _fail(label: str, problem: str, value: object, *, field: str | None = None) -> NoReturn:
    """Raise for a bad ``value`` at ``label`` (a field name, or ``field[index]``)."""
    raise InvalidRequestError(f"{label}: {problem}, got {value!r}", field=field or label)


def _int(
    value: object, name: str, *, low: int, high: int | None = None, field: str | None = None
) -> int:
    if type(value) is not int:  # bool is an int subclass: reject it too
        _fail(name, "expected an integer", value, field=field)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        _fail(name, f"must be {bounds}", value, field=field)
    return value


def _optional_int(value: object, name: str, *, low: int, high: int | None = None) -> int | None:
    return None if value is None else _int(value, name, low=low, high=high)


def _float(value: object, name: str) -> float:
    """A finite float; ints are accepted and converted, bools and NaN/inf are not."""
    if type(value) is not float and type(value) is not int:
        _fail(name, "expected a number", value)
    if not math.isfinite(value):
        _fail(name, "must be a finite number", value)
    return value if type(value) is float else float(value)


def _sequence(value: object, name: str) -> tuple[object, ...]:
    if isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    _fail(name, "expected a list", value)


def _token_ids(value: object) -> tuple[int, ...]:
    items = _sequence(value, "stop_token_ids")
    if len(items) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(items)}",
            field="stop_token_ids",
        )
    for index, item in enumerate(items):
        _int(item, f"stop_token_ids[{index}]", low=0, field="stop_token_ids")
    return items  # type: ignore[return-value]  # every item checked above


def _stop_strings(value: object) -> tuple[str, ...]:
    items = _sequence(value, "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(items)}", field="stop"
        )
    for index, item in enumerate(items):
        if not isinstance(item, str):
            _fail(f"stop[{index}]", "expected a string", item, field="stop")
        if item == "":
            _fail(f"stop[{index}]", "must be a non-empty string", item, field="stop")
        if len(item) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop[{index}]: at most {MAX_STOP_STRING_CHARS} characters, got {len(item)}",
                field="stop",
            )
    return items  # type: ignore[return-value]  # every item checked above


_PATH = re.compile(r"^(?P<problem>.*) - at `\$\.(?P<path>[A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`")


def _translate(error: msgspec.ValidationError) -> InvalidRequestError:
    """Reword a msgspec validation error so that it starts with the field it is about."""
    text = str(error)
    if match := _PATH.match(text):
        path = match["path"]
        field = path.split("[", 1)[0]
        problem = match["problem"]
        return InvalidRequestError(f"{path}: {problem[:1].lower()}{problem[1:]}", field=field)
    if match := _UNKNOWN.match(text):
        name = match["name"]
        valid = ", ".join(SamplingParams.__struct_fields__)
        return InvalidRequestError(f"{name}: unknown field; valid fields: {valid}", field=name)
    return InvalidRequestError(f"sampling params: {text}")
