"""Per-request sampling parameters, shared by clients, the scheduler and the workers."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import NoReturn

import msgspec
from msgspec.structs import force_setattr

from shared.errors import InvalidRequestError
from shared.structured_output import StructuredOutput

__all__ = [
    "MAX_BAD_WORDS",
    "MAX_BAD_WORD_TOKENS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKEN_ID_LIST",
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
INT64_MAX = 2**63 - 1
"""The largest integer a request carries (they travel as int64)."""
MAX_SEED = INT64_MAX
MAX_LOGIT_BIAS = 1024
"""Most tokens one ``logit_bias`` may name (OpenAI allows 300)."""
MAX_TOKEN_ID_LIST = 65536
"""Most ids an ``allowed_token_ids`` may list (a vocabulary's worth)."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest temperature or repetition penalty: the workers sample in float32."""
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 64
"""Most bad words per request, and tokens per word."""


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
    prompt_logprobs: int | None = None
    """Logprobs of the prompt's tokens (from its second on), each with the top
    ``prompt_logprobs`` tokens of its position and its rank, from the raw logits;
    ``None`` = off. Such a request reads nothing from the prefix cache (every position
    is computed), so ``cached_tokens`` is 0 for it."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds already, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence in the output so far, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or the output so far: a positive logit divided by it, a
    negative one multiplied (> 0; 1 = off)."""
    min_p: float = 0.0
    """After temperature: drop tokens less likely than ``min_p`` times the most likely
    one, in [0, 1] (random sampling only, like top-k and top-p)."""
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] = ()
    """Token id -> a bias in [-100, 100] added to its logit (stored as sorted pairs)."""
    allowed_token_ids: tuple[int, ...] = ()
    """When given, every other token is masked (``()``: all allowed)."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences never generated: the last token of one is masked wherever the
    output ends in the rest of it (a one-token word is always masked). The front end
    fills it from ``bad_words`` (strings) with the model's tokenizer."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request at the end of its text."""
    structured_outputs: StructuredOutput | None = None
    """What every sample's text must match: a JSON schema, any JSON object, a regex,
    one of a list of strings, or a grammar (:class:`~shared.structured_output.
    StructuredOutput`; a mapping of its fields is taken too). The scheduler masks each
    token that could not continue a match; a sample ends when the match is complete."""

    num_speculative_tokens: int | None = None
    """Tokens prompt lookup may propose for this request per step (speculative decoding,
    exact: the output is what the request would produce without it); ``None`` = the
    server's ``num_speculative_tokens``, 0 = none for this request. At most the server's
    setting; not with ``structured_outputs``."""

    def __post_init__(self) -> None:
        max_tokens = _optional_int(self.max_tokens, "max_tokens", low=1)
        min_tokens = _int(self.min_tokens, "min_tokens", low=0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens: must be <= max_tokens ({max_tokens}), got {min_tokens}",
                field="min_tokens",
            )
        self._store("temperature", _float(self.temperature, "temperature"))
        if not 0 <= self.temperature <= FLOAT32_MAX:
            _fail(
                "temperature",
                f"must be between 0 and {FLOAT32_MAX:.7g} (float32)",
                self.temperature,
            )
        self._store("top_p", _float(self.top_p, "top_p"))
        if not 0 < self.top_p <= 1:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        _int(self.top_k, "top_k", low=0)
        _optional_int(self.seed, "seed", low=0, high=MAX_SEED)
        stop_ids = _ids(self.stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        self._store("stop_token_ids", stop_ids)
        self._store("stop", _stop_strings(self.stop))
        _int(self.n, "n", low=1, high=MAX_N)
        _optional_int(self.logprobs, "logprobs", low=0, high=MAX_LOGPROBS)
        _optional_int(self.prompt_logprobs, "prompt_logprobs", low=0, high=MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            self._store(name, _bounded(getattr(self, name), name, -2.0, 2.0))
        self._store("repetition_penalty", _float(self.repetition_penalty, "repetition_penalty"))
        if not 0 < self.repetition_penalty <= FLOAT32_MAX:
            bounds = f"> 0 and <= {FLOAT32_MAX:.7g} (float32)"
            _fail("repetition_penalty", f"must be {bounds}", self.repetition_penalty)
        self._store("min_p", _bounded(self.min_p, "min_p", 0.0, 1.0))
        self._store("logit_bias", _logit_bias(self.logit_bias))
        self._store("allowed_token_ids", _ids(self.allowed_token_ids, "allowed_token_ids"))
        self._store("bad_words_token_ids", _bad_words(self.bad_words_token_ids))
        self._store("structured_outputs", _structured(self.structured_outputs))
        _optional_int(self.num_speculative_tokens, "num_speculative_tokens", low=0, high=16)
        if self.num_speculative_tokens and self.structured_outputs is not None:
            _fail(
                "num_speculative_tokens",
                "speculative decoding does not run with structured_outputs",
                self.num_speculative_tokens,
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if type(getattr(self, name)) is not bool:
                _fail(name, "expected a boolean", getattr(self, name))

    def _store(self, name: str, value: object) -> None:
        if value is not getattr(self, name):
            force_setattr(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Presence, frequency or repetition penalties: the sampler needs the tokens."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def shapes_logits(self) -> bool:
        """Anything that changes the logits before the pick (penalties, bias, allowed
        tokens, bad words): even a greedy row needs the sampler then."""
        return self.penalised or bool(
            self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
        )

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
    if value > INT64_MAX:
        _fail(name, f"must be at most {INT64_MAX} (int64)", value, field=field)
    return value


def _optional_int(value: object, name: str, *, low: int, high: int | None = None) -> int | None:
    return None if value is None else _int(value, name, low=low, high=high)


def _float(value: object, name: str, field: str | None = None) -> float:
    """A finite float; ints are accepted and converted, bools and NaN/inf are not."""
    if type(value) is not float and type(value) is not int:
        _fail(name, "expected a number", value, field=field)
    if not math.isfinite(value):
        _fail(name, "must be a finite number", value, field=field)
    return value if type(value) is float else float(value)


def _bounded(value: object, name: str, low: float, high: float, field: str | None = None) -> float:
    number = _float(value, name, field)
    if not low <= number <= high:
        _fail(name, f"must be between {low:g} and {high:g}", value, field=field)
    return number


def _ids(
    value: object, name: str, limit: int = MAX_TOKEN_ID_LIST, field: str | None = None
) -> tuple[int, ...]:
    """A list of token ids (at most ``limit``) as a tuple; errors name ``field``."""
    field = field or name
    items = _sequence(value, name, field)
    if len(items) > limit:
        raise InvalidRequestError(
            f"{name}: at most {limit} token ids, got {len(items)}", field=field
        )
    for index, item in enumerate(items):
        _int(item, f"{name}[{index}]", low=0, field=field)
    return items  # type: ignore[return-value]  # every item checked above


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping (or pairs) of token id -> bias, as sorted ``(id, bias)`` pairs."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        pairs = list(_sequence(value, "logit_bias"))
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            _fail("logit_bias", "expected a mapping of token id -> bias", value)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}", field="logit_bias"
        )
    checked = {}
    for token, bias in pairs:
        _int(token, f"logit_bias[{token!r}]", low=0, field="logit_bias")
        checked[token] = _bounded(bias, f"logit_bias[{token}]", -100.0, 100.0, "logit_bias")
    if len(checked) != len(pairs):
        _fail("logit_bias", "a token id given twice", value)
    out = tuple(sorted(checked.items()))
    return value if out == value else out  # type: ignore[return-value]


def _structured(value: object) -> StructuredOutput | None:
    if value is None or isinstance(value, StructuredOutput):
        return value
    if not isinstance(value, Mapping):
        _fail("structured_outputs", "expected an object", value)
    try:
        return msgspec.convert(dict(value), StructuredOutput)
    except msgspec.ValidationError as error:
        if isinstance(error.__cause__, InvalidRequestError):
            raise error.__cause__ from None
        raise InvalidRequestError(
            f"structured_outputs: {error}", field="structured_outputs"
        ) from None


def _bad_words(value: object) -> tuple[tuple[int, ...], ...]:
    name = "bad_words_token_ids"
    words = _sequence(value, name)
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequestError(
            f"{name}: at most {MAX_BAD_WORDS} words, got {len(words)}", field=name
        )
    out = []
    for index, word in enumerate(words):
        ids = _ids(word, f"{name}[{index}]", MAX_BAD_WORD_TOKENS, name)
        if not ids:
            _fail(f"{name}[{index}]", "must not be empty", word, field=name)
        out.append(ids)
    result = tuple(out)
    return value if result == value else result  # type: ignore[return-value]


def _sequence(value: object, name: str, field: str | None = None) -> tuple[object, ...]:
    if isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    _fail(name, "expected a list", value, field=field)


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


_PATH = re.compile(
    r"^(?P<problem>.*) - at (?:`key` in )?"
    r"`\$\.(?P<path>[A-Za-z_][A-Za-z0-9_]*(?:\[(?:\d+|\.\.\.)\])*)`$"
)
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
