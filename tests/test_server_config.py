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


def test_loopback_tcp_and_ipc_are_accepted() -> None:
    cfg = load_server_config(
        env={}, overrides={"frontend": "tcp://127.0.0.1:5555", "worker_endpoint": "ipc://w.sock"}
    )
    assert cfg.frontend.startswith("tcp://127.0.0.1")
    assert load_server_config(env={}, overrides={"frontend": "tcp://localhost:1"})


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
