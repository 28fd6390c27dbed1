"""One declaration per field drives checking, TOML, env vars, flags and help.

A throwaway settings table, declared only as a struct, is loaded from every layer and
given flags; the real tables' flags are checked against their declarations.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec
import pytest
import typer
from msgspec import Meta
from typer.testing import CliRunner

from expeditor.cli import app
from expeditor.cli_options import settings_options
from shared.config import SCHEDULER_FIELDS, SchedulerConfig
from shared.config_fields import (
    Check,
    Settings,
    field_spec,
    field_specs,
    flag_name,
    load_settings,
    settings_to_toml,
)
from shared.errors import ConfigError
from shared.server_config import SERVER_FIELDS, ServerConfig


class Toy(Settings, frozen=True):
    TABLE: ClassVar[str] = "toy"

    size: Annotated[int, Meta(ge=1, description="How big.")] = 4
    ratio: Annotated[float, Meta(gt=0, le=1, description="How much.")] = 0.5
    mode: Annotated[Literal["a", "b"], Meta(description="Which one.")] = "a"
    label: Annotated[str, Meta(description="What it is called.")] = ""
    limit: Annotated[int, Meta(ge=0, description="A cap; unset = none.")] | None = None
    loud: Annotated[bool, Meta(description="Shout.")] = False
    pairs: Annotated[
        int, Meta(ge=0, description="An even count."), Check(lambda n: n % 2 == 0, "even")
    ] = 0


def test_a_table_needs_only_its_declaration(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[toy]\nsize = 2\nlabel = "x"\nratio = 1\n[other]\nsize = "ignored"\n')
    env = {"EXPEDITOR_RATIO": "0.25", "EXPEDITOR_LOUD": "yes", "EXPEDITOR_LIMIT": "7"}
    toy = load_settings(Toy, path, env=env, overrides={"mode": "b", "limit": None, "pairs": 4})
    assert toy == Toy(size=2, ratio=0.25, mode="b", label="x", limit=7, loud=True, pairs=4)
    assert load_settings(Toy, path, env={}).ratio == 1.0
    assert load_settings(Toy, env={"EXPEDITOR_LIMIT": "none"}) == Toy()
    assert [spec.help for spec in field_specs(Toy).values()][:2] == ["How big.", "How much."]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"size": 0}, "size: must be a positive integer, got 0"),
        ({"size": 2.0}, "size: expected an integer, got 2.0"),
        ({"ratio": 0}, "ratio: must be in (0, 1], got 0.0"),
        ({"ratio": math.inf}, "ratio: must be a finite number, got inf"),
        ({"mode": "c"}, "mode: must be one of 'a', 'b', got 'c'"),
        ({"label": 1}, "label: expected a string, got 1"),
        ({"limit": -1}, "limit: must be a non-negative integer, got -1"),
        ({"loud": 1}, "loud: expected a boolean, got 1"),
        ({"pairs": 3}, "pairs: must be even, got 3"),
    ],
)
def test_construction_checks_the_declaration(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Toy(**values)
    assert str(info.value) == message
    assert info.value.field == next(iter(values))


def test_msgspec_decoding_checks_the_declaration_too() -> None:
    assert msgspec.json.decode(b'{"pairs": 2}', type=Toy).pairs == 2
    with pytest.raises(msgspec.ValidationError, match="pairs"):
        msgspec.json.decode(b'{"pairs": 3}', type=Toy)


def test_errors_name_the_layer(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[toy]\nsise = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'sise' in \[toy\] \(did you mean 'size'"):
        load_settings(Toy, path, env={})
    path.write_text("[toy]\nratio = 2\n")
    with pytest.raises(ConfigError, match=rf"^ratio: .* \(from {path} \[toy\]\)$"):
        load_settings(Toy, path, env={})
    with pytest.raises(ConfigError) as info:
        load_settings(Toy, env={"EXPEDITOR_LIMIT": "many"})
    assert str(info.value) == (
        "limit: expected an integer or 'none', got 'many' (from environment variable "
        "EXPEDITOR_LIMIT)"
    )
    with pytest.raises(ConfigError, match=r"^pairs: must be even, got 5 \(from flag --pairs\)$"):
        load_settings(Toy, env={}, overrides={"pairs": 5})


def test_to_toml_round_trips(tmp_path: Path) -> None:
    toy = Toy(size=9, ratio=0.75, mode="b", label='say "hi"\n', loud=True, pairs=2)
    text = settings_to_toml(toy)
    assert text.startswith("[toy]\n# How big.\nsize = 9\n")
    assert "limit" not in text  # None is left out
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_settings(Toy, path, env={}) == toy


def test_flags_come_from_the_declaration() -> None:
    seen: dict[str, Any] = {}
    toy_app = typer.Typer()

    @toy_app.command()
    @settings_options(Toy, "toy_overrides", "Toy settings")
    def run(*, toy_overrides: dict[str, Any]) -> None:
        seen.update(toy_overrides)

    runner = CliRunner()
    result = runner.invoke(toy_app, ["--size", "3", "--mode", "b", "--no-loud", "--ratio", "1"])
    assert result.exit_code == 0, result.output
    assert load_settings(Toy, env={}, overrides=seen) == Toy(size=3, mode="b", ratio=1.0)
    assert seen["label"] is None  # not given: leaves lower layers alone
    assert runner.invoke(toy_app, ["--mode", "c"]).exit_code != 0
    assert runner.invoke(toy_app, ["--size", "x"]).exit_code != 0
    help_text = " ".join(runner.invoke(toy_app, ["--help"], terminal_width=200).output.split())
    for name, spec in field_specs(Toy).items():
        assert flag_name(name) in help_text and spec.help in help_text


@pytest.mark.parametrize(
    ("command", "tables"),
    [
        ("serve", ((SchedulerConfig, SCHEDULER_FIELDS), (ServerConfig, SERVER_FIELDS))),
        ("simulate", ((SchedulerConfig, SCHEDULER_FIELDS),)),
        ("worker", ((ServerConfig, ("worker_endpoint", "device", "insecure_tcp")),)),
    ],
)
def test_real_flags_match_their_declarations(command: str, tables: tuple[Any, ...]) -> None:
    callbacks = {info.callback.__name__: info.callback for info in app.registered_commands}
    parameters = inspect.signature(callbacks[command]).parameters
    for cls, names in tables:
        for name in names:
            spec = field_spec(cls, name)
            value_type, option = get_args(parameters[name].annotation)
            assert option.help == spec.help
            # Inside Annotated, typer reads Option's first argument as a flag, not a default.
            declared = (option.default, *option.param_decls)
            flag = flag_name(name)
            if spec.kind is bool:
                assert declared == (f"{flag}/--no-{flag[2:]}",)
                assert value_type == bool | None
            else:
                assert declared == (flag,)
                assert value_type == spec.value_type | None
