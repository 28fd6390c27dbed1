"""SchedulerConfig validation and the file > env > flag loader."""

from __future__ import annotations

import math
from pathlib import Path
from typing import get_args

import msgspec
import pytest

from shared import ConfigError, SchedulerConfig, load_config
from shared.config import (
    FIELD_HELP,
    SCHEDULER_FIELDS,
    config_to_toml,
    env_var_name,
    flag_name,
)
from shared.config_fields import field_spec


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "expeditor.toml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- the struct


def test_defaults_are_valid_and_match_the_spec() -> None:
    cfg = SchedulerConfig()
    assert cfg.block_size == 16
    assert cfg.num_gpu_blocks is None
    assert cfg.num_cpu_blocks == 0
    assert cfg.max_num_seqs == 256
    assert cfg.max_num_batched_tokens == 8192
    assert cfg.max_model_len == 4096
    assert cfg.long_prefill_token_threshold == 0
    assert cfg.watermark == 0.01
    assert cfg.preemption_mode == "auto"
    assert cfg.policy == "fcfs"
    assert cfg.aging_rate == 0.01
    assert cfg.fair_share is True
    assert cfg.max_preemptions == 8
    assert cfg.max_waiting_requests == 4096
    assert cfg.enable_prefix_caching is True
    assert cfg.overlap_scheduling is True
    assert cfg.swap_bandwidth_gbps == 16.0
    assert cfg.prefill_tokens_per_s == 20000.0
    assert cfg.swap_overhead_ms == 0.5


def test_every_field_has_help() -> None:
    assert tuple(FIELD_HELP) == SCHEDULER_FIELDS
    assert all(text and "\n" not in text for text in FIELD_HELP.values())


def test_config_is_frozen() -> None:
    cfg = SchedulerConfig()
    with pytest.raises(AttributeError):
        cfg.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize("size", [1, 2, 16, 256])
def test_block_size_accepts_powers_of_two(size: int) -> None:
    assert SchedulerConfig(block_size=size).block_size == size


BAD_VALUES: list[tuple[str, object]] = [
    ("block_size", 0),
    ("block_size", -3),
    ("block_size", 3),
    ("block_size", 512),
    ("block_size", "16"),
    ("block_size", True),
    ("block_size", 16.0),
    ("num_gpu_blocks", 0),
    ("num_gpu_blocks", "100"),
    ("num_cpu_blocks", -1),
    ("num_cpu_blocks", False),
    ("max_num_seqs", 0),
    ("max_num_batched_tokens", 0),
    ("max_model_len", 1),
    ("long_prefill_token_threshold", -1),
    ("watermark", -0.1),
    ("watermark", 1.0),
    ("watermark", math.nan),
    ("watermark", math.inf),
    ("watermark", "0.1"),
    ("watermark", True),
    ("preemption_mode", "never"),
    ("preemption_mode", 1),
    ("policy", "lifo"),
    ("policy", "FCFS"),
    ("aging_rate", -0.5),
    ("aging_rate", math.inf),
    ("fair_share", 1),
    ("fair_share", "false"),
    ("prefix_cache_cpu_blocks", -1),
    ("prefix_cache_cpu_blocks", 1),  # more than num_cpu_blocks (0)
    ("cache_aware_admission", 1),
    ("max_bypass", -1),
    ("max_bypass", 1.5),
    ("max_preemptions", 0),
    ("max_waiting_requests", 0),
    ("enable_prefix_caching", 1),
    ("enable_prefix_caching", "true"),
    ("free_out_of_window_blocks", 1),
    ("overlap_scheduling", 0),
    ("overlap_scheduling", "on"),
    ("swap_bandwidth_gbps", 0.0),
    ("swap_bandwidth_gbps", math.nan),
    ("prefill_tokens_per_s", -1.0),
    ("prefill_tokens_per_s", math.inf),
    ("swap_overhead_ms", -0.1),
    ("swap_overhead_ms", math.nan),
    ("max_queued_per_user", 0),
    ("max_queued_per_user", "many"),
    ("num_speculative_tokens", -1),
    ("num_speculative_tokens", 17),
    ("prompt_lookup_min", 0),
    ("speculative_backoff", "sometimes"),
    ("prompt_lookup_max", 17),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_is_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: ") as info:
        SchedulerConfig(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_every_field_has_a_bad_value_case() -> None:
    assert {field for field, _ in BAD_VALUES} == set(SCHEDULER_FIELDS)


def test_error_message_reads_well() -> None:
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(max_num_seqs=-3)
    assert str(info.value) == "max_num_seqs: must be a positive integer, got -3"


def test_int_for_float_field_is_stored_as_float() -> None:
    cfg = SchedulerConfig(watermark=0, swap_bandwidth_gbps=32)
    assert type(cfg.watermark) is float
    assert type(cfg.swap_bandwidth_gbps) is float


def test_watermark_blocks() -> None:
    assert SchedulerConfig(watermark=0.01).watermark_blocks(1000) == 10
    assert SchedulerConfig(watermark=0.01).watermark_blocks(99) == 0
    assert SchedulerConfig(watermark=0.0).watermark_blocks(1000) == 0


def test_msgspec_decoding_validates_and_rejects_bool_for_int() -> None:
    cfg = msgspec.json.decode(b'{"block_size": 32}', type=SchedulerConfig)
    assert cfg.block_size == 32
    with pytest.raises(msgspec.ValidationError, match="block_size"):
        msgspec.json.decode(b'{"block_size": true}', type=SchedulerConfig)
    with pytest.raises(msgspec.ValidationError, match="block_size"):
        msgspec.json.decode(b'{"block_size": 24}', type=SchedulerConfig)
    with pytest.raises(msgspec.ValidationError, match="nonsense"):
        msgspec.json.decode(b'{"nonsense": 1}', type=SchedulerConfig)


def test_field_spec_reads_the_declaration() -> None:
    block_size = field_spec(SchedulerConfig, "block_size")
    assert (block_size.kind, block_size.default, block_size.optional) == (int, 16, False)
    assert block_size.help == FIELD_HELP["block_size"]
    assert field_spec(SchedulerConfig, "watermark").kind is float
    assert field_spec(SchedulerConfig, "enable_prefix_caching").kind is bool
    assert field_spec(SchedulerConfig, "num_gpu_blocks").optional
    policy = field_spec(SchedulerConfig, "policy")
    assert policy.kind is str and get_args(policy.value_type) == ("fcfs", "priority")
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        field_spec(SchedulerConfig, "bock_size")


def test_defaults_come_from_the_declaration() -> None:
    cfg = SchedulerConfig()
    for name in SCHEDULER_FIELDS:
        assert getattr(cfg, name) == field_spec(SchedulerConfig, name).default


def test_names_of_env_vars_and_flags() -> None:
    assert env_var_name("max_num_seqs") == "EXPEDITOR_MAX_NUM_SEQS"
    assert flag_name("max_num_seqs") == "--max-num-seqs"


# --------------------------------------------------------------------------- the loader


def test_no_sources_gives_defaults() -> None:
    assert load_config(env={}) == SchedulerConfig()


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[scheduler]\nmax_num_seqs = 10\nblock_size = 32\n")
    env = {"EXPEDITOR_MAX_NUM_SEQS": "20", "EXPEDITOR_MAX_MODEL_LEN": "1024"}

    assert load_config(path, env={}).max_num_seqs == 10
    assert load_config(path, env=env).max_num_seqs == 20
    cfg = load_config(path, env=env, overrides={"max_num_seqs": 30})
    assert cfg.max_num_seqs == 30
    # Each layer only replaces what it sets.
    assert cfg.block_size == 32
    assert cfg.max_model_len == 1024
    assert cfg.max_num_batched_tokens == 8192


def test_none_override_does_not_mask_lower_layers(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[scheduler]\nmax_num_seqs = 10\n")
    cfg = load_config(path, env={}, overrides={"max_num_seqs": None, "policy": None})
    assert cfg.max_num_seqs == 10
    assert cfg.policy == "fcfs"


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPEDITOR_MAX_NUM_SEQS", "7")
    assert load_config().max_num_seqs == 7


@pytest.mark.parametrize(
    ("variable", "raw", "field", "expected"),
    [
        ("EXPEDITOR_BLOCK_SIZE", "64", "block_size", 64),
        ("EXPEDITOR_BLOCK_SIZE", " 8 ", "block_size", 8),
        ("EXPEDITOR_WATERMARK", "0.05", "watermark", 0.05),
        ("EXPEDITOR_WATERMARK", "0", "watermark", 0.0),
        ("EXPEDITOR_PREEMPTION_MODE", "swap", "preemption_mode", "swap"),
        ("EXPEDITOR_POLICY", "priority", "policy", "priority"),
        ("EXPEDITOR_NUM_GPU_BLOCKS", "500", "num_gpu_blocks", 500),
        ("EXPEDITOR_NUM_GPU_BLOCKS", "none", "num_gpu_blocks", None),
        ("EXPEDITOR_NUM_GPU_BLOCKS", "None", "num_gpu_blocks", None),
        ("EXPEDITOR_NUM_GPU_BLOCKS", "", "num_gpu_blocks", None),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "0", "enable_prefix_caching", False),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "FALSE", "enable_prefix_caching", False),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "no", "enable_prefix_caching", False),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "Off", "enable_prefix_caching", False),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "1", "enable_prefix_caching", True),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "True", "enable_prefix_caching", True),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "YES", "enable_prefix_caching", True),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "on", "enable_prefix_caching", True),
    ],
)
def test_env_values_are_parsed_per_field_type(
    variable: str, raw: str, field: str, expected: object
) -> None:
    value = getattr(load_config(env={variable: raw}), field)
    assert value == expected
    assert type(value) is type(expected)


def test_env_none_clears_num_gpu_blocks_set_in_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[scheduler]\nnum_gpu_blocks = 100\n")
    assert load_config(path, env={}).num_gpu_blocks == 100
    assert load_config(path, env={"EXPEDITOR_NUM_GPU_BLOCKS": "none"}).num_gpu_blocks is None


@pytest.mark.parametrize(
    ("variable", "raw", "field"),
    [
        ("EXPEDITOR_BLOCK_SIZE", "abc", "block_size"),
        ("EXPEDITOR_BLOCK_SIZE", "16.0", "block_size"),
        ("EXPEDITOR_BLOCK_SIZE", "", "block_size"),
        ("EXPEDITOR_BLOCK_SIZE", "24", "block_size"),
        ("EXPEDITOR_NUM_GPU_BLOCKS", "lots", "num_gpu_blocks"),
        ("EXPEDITOR_WATERMARK", "high", "watermark"),
        ("EXPEDITOR_WATERMARK", "nan", "watermark"),
        ("EXPEDITOR_ENABLE_PREFIX_CACHING", "maybe", "enable_prefix_caching"),
        ("EXPEDITOR_POLICY", "random", "policy"),
    ],
)
def test_bad_env_value_names_field_and_variable(variable: str, raw: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={variable: raw})
    message = str(info.value)
    assert message.startswith(f"{field}: ")
    assert variable in message
    assert info.value.field == field
    assert info.value.source == f"environment variable {variable}"


def test_env_parse_error_message() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"EXPEDITOR_BLOCK_SIZE": "abc"})
    assert str(info.value) == (
        "block_size: expected an integer, got 'abc' (from environment variable "
        "EXPEDITOR_BLOCK_SIZE)"
    )


def test_unrelated_env_vars_are_ignored() -> None:
    env = {"EXPEDITOR_SERVER_PORT": "not a number", "PATH": "/bin", "EXPEDITOR_": "x"}
    assert load_config(env=env) == SchedulerConfig()


def test_file_with_other_tables_and_all_types(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
        [server]
        endpoint = "ipc://somewhere"

        [scheduler]
        block_size = 32
        num_gpu_blocks = 2048
        watermark = 0
        policy = "priority"
        enable_prefix_caching = false
        swap_bandwidth_gbps = 25.5

        [worker]
        device = "cuda:0"
        """,
    )
    cfg = load_config(path, env={})
    assert cfg.block_size == 32
    assert cfg.num_gpu_blocks == 2048
    assert cfg.watermark == 0.0 and type(cfg.watermark) is float
    assert cfg.policy == "priority"
    assert cfg.enable_prefix_caching is False
    assert cfg.swap_bandwidth_gbps == 25.5


def test_file_without_scheduler_table_gives_defaults(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[server]\nendpoint = "tcp://127.0.0.1:5555"\n')
    assert load_config(path, env={}) == SchedulerConfig()


def test_path_may_be_a_string(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[scheduler]\nmax_num_seqs = 3\n")
    assert load_config(str(path), env={}).max_num_seqs == 3


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing, env={})
    assert str(missing) in str(info.value)


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[scheduler]\nblock_size = = 16\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_config(path, env={})
    assert str(path) in str(info.value)
    assert "line 2" in str(info.value)  # tomllib's own location survives


def test_scheduler_must_be_a_table(tmp_path: Path) -> None:
    path = write_config(tmp_path, "scheduler = 3\n")
    with pytest.raises(ConfigError, match=r"\[scheduler\] must be a table"):
        load_config(path, env={})


def test_unknown_toml_key_lists_valid_keys(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[scheduler]\nblok_size = 16\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "blok_size" in message
    assert str(path) in message
    assert "did you mean 'block_size'" in message
    for field in SCHEDULER_FIELDS:
        assert field in message


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('block_size = "16"', "block_size"),
        ("block_size = true", "block_size"),
        ("block_size = 12", "block_size"),
        ("watermark = 2.0", "watermark"),
        ("watermark = nan", "watermark"),
        ('enable_prefix_caching = "yes"', "enable_prefix_caching"),
        ("preemption_mode = 1", "preemption_mode"),
    ],
)
def test_bad_file_value_names_field_and_file(tmp_path: Path, line: str, field: str) -> None:
    path = write_config(tmp_path, f"[scheduler]\n{line}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"{field}: ")
    assert str(path) in str(info.value)
    assert info.value.field == field


def test_bad_file_value_is_reported_even_if_overridden(tmp_path: Path) -> None:
    path = write_config(tmp_path, "[scheduler]\nblock_size = 12\n")
    with pytest.raises(ConfigError, match="block_size"):
        load_config(path, env={"EXPEDITOR_BLOCK_SIZE": "16"})


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", "16"), ("max_num_seqs", 0), ("enable_prefix_caching", 1), ("policy", "x")],
)
def test_bad_override_names_field_and_flag(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={field: value})
    assert str(info.value).startswith(f"{field}: ")
    assert flag_name(field) in str(info.value)


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"unknown override 'max_seqs'.*max_num_seqs"):
        load_config(env={}, overrides={"max_seqs": 4})


# --------------------------------------------------------------------------- writing TOML


def test_config_to_toml_round_trips_defaults(tmp_path: Path) -> None:
    cfg = SchedulerConfig()
    text = config_to_toml(cfg)
    assert text.startswith("[scheduler]\n")
    assert "num_gpu_blocks" not in text  # None is omitted
    path = write_config(tmp_path, text)
    assert load_config(path, env={}) == cfg


def test_config_to_toml_round_trips_every_field_changed(tmp_path: Path) -> None:
    cfg = SchedulerConfig(
        block_size=8,
        num_gpu_blocks=1234,
        num_cpu_blocks=77,
        max_num_seqs=3,
        max_num_batched_tokens=100,
        max_model_len=2,
        long_prefill_token_threshold=512,
        watermark=1e-5,
        preemption_mode="recompute",
        policy="priority",
        aging_rate=0.0,
        fair_share=False,
        cache_aware_admission=True,
        max_bypass=0,
        max_preemptions=1,
        max_waiting_requests=9,
        enable_prefix_caching=False,
        free_out_of_window_blocks=False,
        overlap_scheduling=False,
        num_speculative_tokens=3,
        speculative_backoff=False,
        prompt_lookup_min=3,
        prompt_lookup_max=7,
        swap_bandwidth_gbps=1e20,
        prefill_tokens_per_s=0.3,
        swap_overhead_ms=0.0,
        max_queued_per_user=7,
    )
    # The host tier needs the prefix cache that cfg turns off: it changes in a second one.
    tiered = msgspec.structs.replace(cfg, enable_prefix_caching=True, prefix_cache_cpu_blocks=5)
    default = SchedulerConfig()
    changed = {name for name in SCHEDULER_FIELDS if getattr(cfg, name) != getattr(default, name)}
    assert set(SCHEDULER_FIELDS) - changed == {"prefix_cache_cpu_blocks"}
    assert tiered.prefix_cache_cpu_blocks != default.prefix_cache_cpu_blocks
    for each in (cfg, tiered):
        path = write_config(tmp_path, config_to_toml(each))
        assert load_config(path, env={}) == each
