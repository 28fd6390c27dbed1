"""The [server] settings: layering and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.server_config import ServerConfig, load_server_config, server_config_to_toml


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nworkers = 2\ndevice = "cpu"\nclient_timeout_s = 3.0\n')
    cfg = load_server_config(
        path,
        env={"EXPEDITOR_WORKERS": "3", "EXPEDITOR_RESTART_WORKERS": "no"},
        overrides={"workers": 4, "model": None},
    )
    assert cfg.workers == 4 and cfg.device == "cpu" and cfg.client_timeout_s == 3.0
    assert cfg.restart_workers is False and cfg.model == ""
    assert load_server_config(path, env={"EXPEDITOR_WORKERS": "3"}).workers == 3


def test_round_trip_through_toml(tmp_path: Path) -> None:
    cfg = ServerConfig(model='we"ird', frontend="ipc://x/fe.sock", workers=2, restart_workers=False)
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
