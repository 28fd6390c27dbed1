"""The [server] settings: layering and validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shared.config import SCHEDULER_FIELDS
from shared.config_fields import help_texts
from shared.errors import ConfigError
from shared.server_config import (
    SERVER_FIELDS,
    ServerConfig,
    load_server_config,
    server_config_to_toml,
)


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\ncpu_threads = 2\ndevice = "cpu"\nclient_timeout_s = 3.0\n')
    cfg = load_server_config(
        path,
        env={"EXPEDITOR_CPU_THREADS": "3", "EXPEDITOR_RESTART_WORKERS": "no"},
        overrides={"cpu_threads": 4, "model": None},
    )
    assert cfg.cpu_threads == 4 and cfg.device == "cpu" and cfg.client_timeout_s == 3.0
    assert cfg.restart_workers is False and cfg.model == ""
    assert load_server_config(path, env={"EXPEDITOR_CPU_THREADS": "3"}).cpu_threads == 3


def test_round_trip_through_toml(tmp_path: Path) -> None:
    cfg = ServerConfig(
        model='we"ird', frontend="ipc://x/fe.sock", cpu_threads=2, restart_workers=False
    )
    path = tmp_path / "c.toml"
    path.write_text(server_config_to_toml(cfg))
    assert load_server_config(path, env={}) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"workers": 0}, "workers"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"worker_timeout_s": 0.0}, "worker_timeout_s"),
        ({"device": "tpu"}, "device"),
        ({"frontend": "http://x"}, "frontend"),
        ({"frontend": "tcp://10.1.2.3:5555"}, "loopback"),
        ({"worker_endpoint": "tcp://example.com:1"}, "CURVE"),
    ],
)
def test_bad_values_name_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_server_config(env={}, overrides=overrides)


CURVE = {"curve_server_key": "keys/server.key_secret", "curve_authorized_clients": "keys/ok"}


def test_ipc_paths_need_no_keys() -> None:
    cfg = load_server_config(
        env={}, overrides={"frontend": "ipc://x/fe.sock", "worker_endpoint": "ipc://w.sock"}
    )
    assert cfg.worker_endpoint == "ipc://w.sock" and not cfg.curve


def test_loopback_tcp_needs_curve_or_the_insecure_opt_out() -> None:
    for address in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:1"):
        with pytest.raises(ConfigError, match="tcp:// is open to every local user") as info:
            ServerConfig(frontend=address)
        assert info.value.field == "frontend"
        assert "insecure_tcp" in str(info.value) and "CURVE" in str(info.value)
        insecure = load_server_config(env={}, overrides={"frontend": address, "insecure_tcp": True})
        assert insecure.insecure_tcp and not insecure.curve
        assert load_server_config(env={}, overrides={"frontend": address, **CURVE}).curve
    with pytest.raises(ConfigError, match=r"worker_endpoint: .*insecure_tcp"):
        load_server_config(env={}, overrides={"worker_endpoint": "tcp://127.0.0.1:1"})


def test_beyond_loopback_only_with_curve() -> None:
    with pytest.raises(ConfigError, match=r"not a loopback address.*insecure_tcp does not cover"):
        load_server_config(env={}, overrides={"frontend": "tcp://0.0.0.0:1", "insecure_tcp": True})
    cfg = load_server_config(env={}, overrides={"frontend": "tcp://0.0.0.0:5555", **CURVE})
    assert cfg.frontend == "tcp://0.0.0.0:5555"


def test_abstract_ipc_only_with_curve() -> None:
    with pytest.raises(ConfigError, match="abstract socket namespace") as info:
        ServerConfig(worker_endpoint="ipc://@w", insecure_tcp=True)
    assert info.value.field == "worker_endpoint"
    assert load_server_config(env={}, overrides={"worker_endpoint": "ipc://@w", **CURVE}).curve


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (
            {"curve_server_key": "s.key_secret"},
            "curve_authorized_clients",
            "CURVE needs both curve_server_key and curve_authorized_clients",
        ),
        (
            {"curve_authorized_clients": "ok"},
            "curve_server_key",
            "curve_authorized_clients is set, curve_server_key is not",
        ),
        ({"curve_client_key": "c.key_secret"}, "curve_client_key", "without curve_server_key"),
    ],
)
def test_curve_settings_go_together(overrides: dict, field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        ServerConfig(**overrides)
    assert info.value.field == field and str(info.value).startswith(f"{field}:")
    with pytest.raises(ConfigError, match=rf"^\[server\] {field}: .*{message}"):
        load_server_config(env={}, overrides=overrides)


def test_curve_settings_from_env_and_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[server]\nfrontend = "tcp://127.0.0.1:7000"\n'
        'curve_server_key = "/etc/expeditor/keys/server.key_secret"\n'
    )
    env = {
        "EXPEDITOR_CURVE_AUTHORIZED_CLIENTS": "/etc/expeditor/keys/authorized",
        "EXPEDITOR_CURVE_CLIENT_KEY": "/etc/expeditor/keys/worker.key_secret",
    }
    cfg = load_server_config(path, env=env)
    assert cfg.curve and cfg.curve_client_key.endswith("worker.key_secret")
    assert load_server_config(path, env=env) == cfg
    insecure = load_server_config(
        env={"EXPEDITOR_INSECURE_TCP": "yes"}, overrides={"frontend": "tcp://127.0.0.1:1"}
    )
    assert insecure.insecure_tcp is True


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nworkerz = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'workerz'"):
        load_server_config(bad, env={})
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_server_config(bad, env={})
    with pytest.raises(ConfigError, match="not found"):
        load_server_config(tmp_path / "none.toml", env={})
    with pytest.raises(ConfigError, match="expected an integer"):
        load_server_config(env={"EXPEDITOR_WORKERS": "many"})


# --------------------------------------------------------------------------- per-field checks

BAD_VALUES: list[tuple[str, object]] = [
    ("model", 3),
    ("speculative_model", 3),
    ("frontend", "http://x"),
    ("worker_endpoint", "w.sock"),
    ("workers", 0),
    ("workers", True),
    ("tensor_parallel_size", 0),
    ("dist_master_addr", 5),
    ("dist_master_port", 70000),
    ("device", "tpu"),
    ("cpu_threads", -1),
    ("cpu_threads", 1.5),
    ("gpu_memory_utilization", 0.0),
    ("gpu_memory_utilization", 1.5),
    ("cuda_graphs", "no"),
    ("model_impl", "vllm"),
    ("kv_cache_dtype", "int4"),
    ("dtype", "int8"),
    ("client_timeout_s", 0.0),
    ("worker_timeout_s", math.inf),
    ("worker_wait_s", -1.0),
    ("restart_workers", "yes"),
    ("step_timeout_s", math.nan),
    ("shutdown_timeout_s", "30"),
    ("max_frame_bytes", 0),
    ("max_prompt_bytes", 0),
    ("grammar_compile_timeout_s", 0),
    ("grammar_compile_timeout_s", "5"),
    ("curve_server_key", None),
    ("curve_client_key", 1),
    ("curve_authorized_clients", b"keys"),
    ("insecure_tcp", 1),
    ("max_reply_backlog_bytes", 0),
    ("kv_events_endpoint", "http://127.0.0.1:5557"),
    ("kv_events_connect", "yes"),
    ("kv_events_replay_endpoint", "tcp://127.0.0.1:5558"),  # with no kv_events_endpoint
    ("kv_events_topic", 3),
    ("kv_events_buffer_steps", 0),
    ("data_parallel_size", 0),
    ("data_parallel_rank", -1),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_is_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: ") as info:
        ServerConfig(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_every_field_has_a_bad_value_case() -> None:
    assert {field for field, _ in BAD_VALUES} == set(SERVER_FIELDS)


def test_messages_from_the_declared_bounds() -> None:
    cases = [
        ({"workers": 0}, "workers: must be a positive integer, got 0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization: must be in (0, 1], got 1.5"),
        ({"worker_timeout_s": 0}, "worker_timeout_s: must be > 0, got 0.0"),
        ({"device": "tpu"}, "device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ]
    for values, message in cases:
        with pytest.raises(ConfigError) as info:
            ServerConfig(**values)  # type: ignore[arg-type]
        assert str(info.value) == message
    assert ServerConfig(device="cuda:1", client_timeout_s=3).client_timeout_s == 3.0


def test_errors_name_the_layer(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nworkers = "2"\n')
    with pytest.raises(ConfigError) as info:
        load_server_config(path, env={})
    assert str(info.value) == f"workers: expected an integer, got '2' (from {path} [server])"
    with pytest.raises(ConfigError) as info:
        load_server_config(env={"EXPEDITOR_DEVICE": "tpu"})
    assert info.value.source == "environment variable EXPEDITOR_DEVICE"
    assert info.value.field == "device"
    with pytest.raises(ConfigError, match=r"^max_frame_bytes: .* \(from flag --max-frame-bytes\)$"):
        load_server_config(env={}, overrides={"max_frame_bytes": -1})
    with pytest.raises(ConfigError, match=r"unknown override 'worker'.*did you mean 'workers'"):
        load_server_config(env={}, overrides={"worker": 2})


def test_unknown_file_key_suggests_the_field(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[server]\nworkerz = 1\n")
    with pytest.raises(ConfigError, match=r"did you mean 'workers'.*valid keys: model, ") as info:
        load_server_config(path, env={})
    assert info.value.field == "workerz" and info.value.source == str(path)


def test_prompt_limit_below_frame_limit() -> None:
    with pytest.raises(ConfigError, match=r"^\[server\] max_prompt_bytes \(64\) must be below"):
        load_server_config(
            env={"EXPEDITOR_MAX_FRAME_BYTES": "64", "EXPEDITOR_MAX_PROMPT_BYTES": "64"}
        )


def test_to_toml_comments_every_value_and_round_trips(tmp_path: Path) -> None:
    cfg = ServerConfig(
        model="m\n\u00e9",
        frontend="tcp://0.0.0.0:5555",
        worker_endpoint="ipc://@w",
        workers=3,
        device="cuda:1",
        cpu_threads=3,
        tensor_parallel_size=3,
        dist_master_addr="10.0.0.1",
        dist_master_port=29500,
        gpu_memory_utilization=0.5,
        cuda_graphs=False,
        model_impl="transformers",
        speculative_model="draft",
        dtype="bfloat16",
        kv_cache_dtype="fp8_e5m2",
        client_timeout_s=1.5,
        worker_timeout_s=2.0,
        worker_wait_s=3.0,
        restart_workers=False,
        step_timeout_s=4.0,
        shutdown_timeout_s=5.0,
        max_frame_bytes=1000,
        max_prompt_bytes=999,
        grammar_compile_timeout_s=2.5,
        curve_server_key="s.key_secret",
        curve_client_key="c.key_secret",
        curve_authorized_clients="ok",
        insecure_tcp=True,
        max_reply_backlog_bytes=1 << 20,
        kv_events_endpoint="tcp://127.0.0.1:5557",
        kv_events_connect=True,
        kv_events_replay_endpoint="ipc:///run/kv-replay",
        kv_events_topic="kv@10.0.0.1:8000@m",
        kv_events_buffer_steps=5,
        data_parallel_size=2,
        data_parallel_rank=1,
    )
    assert all(getattr(cfg, name) != getattr(ServerConfig(), name) for name in SERVER_FIELDS)
    text = server_config_to_toml(cfg)
    for name, help_text in help_texts(ServerConfig).items():
        assert f"# {help_text}\n{name} = " in text
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_server_config(path, env={}) == cfg


def test_tables_share_no_field_name() -> None:
    """Both tables read EXPEDITOR_<FIELD> and --field flags: a name in both would clash."""
    assert not set(SERVER_FIELDS) & set(SCHEDULER_FIELDS)


def test_tensor_parallel_ranks_are_the_workers() -> None:
    assert ServerConfig(tensor_parallel_size=4).num_ranks == 4
    assert ServerConfig(tensor_parallel_size=4, workers=4).num_ranks == 4
    assert ServerConfig(workers=1).num_ranks == 1
    with pytest.raises(ConfigError, match=r"^workers: with tensor_parallel_size 2") as info:
        ServerConfig(tensor_parallel_size=2, workers=3)
    assert info.value.field == "workers"


def test_workers_without_tensor_parallelism_point_to_replicas() -> None:
    """Mirrors (N workers each running every plan) are refused, naming the flags that
    give N replicas or N ranks instead."""
    with pytest.raises(ConfigError, match=r"^workers: 2 workers without tensor") as info:
        ServerConfig(workers=2)
    assert info.value.field == "workers"
    assert "data_parallel_size = 2" in str(info.value) and "tensor_parallel_size = 2" in str(
        info.value
    )
