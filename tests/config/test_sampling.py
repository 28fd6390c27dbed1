"""SamplingParams validation, untrusted-input conversion and wire round trips."""

from __future__ import annotations

import math

import msgspec
import pytest

from shared import InvalidRequestError, SamplingParams


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.seed is None
    assert params.stop_token_ids == ()
    assert params.stop == ()
    assert params.ignore_eos is False
    assert params.n == 1
    assert params.logprobs is None
    assert not params.greedy


def test_valid_extremes() -> None:
    params = SamplingParams(
        max_tokens=None,
        min_tokens=1000,
        temperature=0.0,
        top_p=1e-9,
        top_k=1,
        seed=2**63 - 1,
        stop_token_ids=(0, 2),
        stop=tuple(f"s{i}" for i in range(16)),
        ignore_eos=True,
        n=64,
        logprobs=20,
    )
    assert params.max_tokens is None
    assert params.seed == 2**63 - 1
    assert SamplingParams(seed=0, logprobs=0, max_tokens=1, min_tokens=1).logprobs == 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"top_k": 50}, False),
    ],
)
def test_greedy(kwargs: dict[str, object], expected: bool) -> None:
    assert SamplingParams(**kwargs).greedy is expected  # type: ignore[arg-type]


def test_is_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]


def test_ints_for_floats_and_lists_for_tuples_are_normalised() -> None:
    params = SamplingParams(temperature=1, top_p=1, stop_token_ids=[1, 2], stop=["x"])  # type: ignore[arg-type]
    assert type(params.temperature) is float
    assert type(params.top_p) is float
    assert params.stop_token_ids == (1, 2)
    assert params.stop == ("x",)
    hash(params)  # every field immutable


BAD_VALUES: list[tuple[str, object]] = [
    ("presence_penalty", 2.5),
    ("presence_penalty", "1"),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 1e39),  # past float32: the workers sample in float32
    ("min_p", 1.5),
    ("min_p", -0.1),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: "x"}),
    ("logit_bias", 3),
    ("allowed_token_ids", (1, -2)),
    ("allowed_token_ids", 7),
    ("bad_words_token_ids", ((),)),
    ("bad_words_token_ids", ((1, -1),)),
    ("bad_words_token_ids", (5,)),
    ("include_stop_str_in_output", 1),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", False),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", 1e39),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", -math.inf),
    ("top_k", -1),
    ("top_k", 2.0),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", True),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", (1, "2")),
    ("stop_token_ids", (True,)),
    ("stop_token_ids", 5),
    ("stop", ("",)),
    ("stop", ("ok", "")),
    ("stop", (1,)),
    ("stop", "abc"),
    ("stop", tuple("abcdefghijklmnopq")),  # 17 strings
    ("ignore_eos", 1),
    ("ignore_eos", "false"),
    ("n", 0),
    ("n", 65),
    ("n", True),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", False),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", 1.0),
    ("structured_outputs", {"regex": "a", "choice": ["b"]}),
    ("structured_outputs", {"choice": []}),
    ("structured_outputs", {"choice": [""]}),
    ("structured_outputs", {"grammar": "x" * (256 * 1024 + 1)}),
    ("structured_outputs", {"schema": {}}),
    ("structured_outputs", "a+"),
    ("num_speculative_tokens", -1),
    ("num_speculative_tokens", 17),
    ("num_speculative_tokens", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_is_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^{field}\b") as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_from_dict_rejects_the_same_values_naming_the_field(field: str, value: object) -> None:
    if isinstance(value, tuple):
        value = list(value)  # as it would arrive from JSON
    with pytest.raises(InvalidRequestError, match=rf"^{field}\b") as info:
        SamplingParams.from_dict({field: value})
    assert info.value.field == field


def test_every_field_has_a_bad_value_case() -> None:
    assert {field for field, _ in BAD_VALUES} == set(SamplingParams.__struct_fields__)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(InvalidRequestError, match=r"^min_tokens: must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


def test_nan_temperature_message() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(temperature=math.nan)
    assert str(info.value) == "temperature: must be a finite number, got nan"


def test_bool_for_n_is_rejected_even_through_json() -> None:
    with pytest.raises(InvalidRequestError, match=r"^n: "):
        SamplingParams(n=True)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.n"):
        msgspec.json.decode(b'{"n": true}', type=SamplingParams)


def test_empty_stop_string_message_points_at_the_item() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop=("end", ""))
    assert str(info.value) == "stop[1]: must be a non-empty string, got ''"
    assert info.value.field == "stop"


def test_from_dict_accepts_valid_input() -> None:
    params = SamplingParams.from_dict(
        {"max_tokens": 5, "temperature": 0, "stop": ["\n"], "stop_token_ids": [2], "seed": 7}
    )
    assert params == SamplingParams(
        max_tokens=5, temperature=0.0, stop=("\n",), stop_token_ids=(2,), seed=7
    )
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_unknown_field() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"temprature": 0.5})
    assert str(info.value).startswith("temprature: unknown field; valid fields: max_tokens")
    assert info.value.field == "temprature"


def test_from_dict_type_error_message() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"top_p": "high"})
    assert str(info.value) == "top_p: expected `float`, got `str`"


def test_from_dict_not_a_mapping() -> None:
    with pytest.raises(InvalidRequestError, match="expected an object, got list"):
        SamplingParams.from_dict([("n", 2)])  # type: ignore[arg-type]


def test_decoding_non_finite_floats_is_rejected() -> None:
    # JSON has no NaN literal, and msgspec refuses numbers that overflow to inf
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.json.decode(b'{"temperature": 1e999}', type=SamplingParams)
    # msgpack carries real NaN floats
    payload = msgspec.msgpack.encode({"temperature": math.nan})
    with pytest.raises(msgspec.ValidationError, match="temperature: must be a finite number"):
        msgspec.msgpack.decode(payload, type=SamplingParams)


ROUND_TRIP_CASES = [
    SamplingParams(),
    SamplingParams(
        max_tokens=None,
        min_tokens=3,
        temperature=0.0,
        top_p=0.9,
        top_k=40,
        seed=12345,
        stop_token_ids=(1, 2, 3),
        stop=("###", "\n\n"),
        ignore_eos=True,
        n=4,
        logprobs=5,
    ),
]


@pytest.mark.parametrize("params", ROUND_TRIP_CASES)
def test_json_round_trip(params: SamplingParams) -> None:
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params


@pytest.mark.parametrize("params", ROUND_TRIP_CASES)
def test_msgpack_round_trip(params: SamplingParams) -> None:
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    assert type(decoded.stop_token_ids) is tuple


def test_defaults_are_omitted_on_the_wire() -> None:
    assert msgspec.json.encode(SamplingParams()) == b"{}"
    assert msgspec.json.encode(SamplingParams(n=2)) == b'{"n":2}'
    # max_tokens=None differs from the default 16, so it must be sent
    assert msgspec.json.decode(msgspec.json.encode(SamplingParams(max_tokens=None))) == {
        "max_tokens": None
    }


def test_speculation_does_not_go_with_structured_outputs() -> None:
    with pytest.raises(InvalidRequestError, match=r"^num_speculative_tokens: .*structured"):
        SamplingParams(num_speculative_tokens=2, structured_outputs={"regex": "a+"})
    assert SamplingParams(num_speculative_tokens=0, structured_outputs={"regex": "a+"})
