"""The daemons' own settings: the ``[server]`` table, ``EXPEDITOR_<FIELD>`` env vars and
flags (same precedence as the scheduler config: flags > env > file > defaults)."""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from typing import Literal

import msgspec

from shared.errors import ConfigError

SERVER_FIELD_HELP: dict[str, str] = {
    "model": "Checkpoint directory (Hugging Face layout); empty = the embedded tiny model.",
    "frontend": "Client endpoint, ipc://PATH or tcp://127.0.0.1:PORT.",
    "worker_endpoint": "Endpoint workers connect to, ipc://PATH or tcp://127.0.0.1:PORT.",
    "workers": "Worker processes (ranks) expected; each runs every plan.",
    "device": "Worker device: auto, cpu, cuda or cuda:N.",
    "gpu_memory_utilization": "Share of GPU memory a CUDA worker may use (weights + KV cache).",
    "client_timeout_s": "A client silent this long while it has requests is gone: abort them.",
    "worker_timeout_s": "A worker silent this long (no heartbeat) is lost.",
    "worker_wait_s": "After losing every worker, requests wait this long for one, then fail.",
    "restart_workers": "serve: restart a worker that died (else its requests fail).",
    "step_timeout_s": "A worker that owes a step this long (heartbeats or not) is hung: killed.",
}


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str = ""
    frontend: str = ""
    worker_endpoint: str = ""
    workers: int = 1
    device: Literal["auto", "cpu", "cuda"] | str = "auto"
    gpu_memory_utilization: float = 0.9
    client_timeout_s: float = 10.0
    worker_timeout_s: float = 5.0
    worker_wait_s: float = 60.0
    restart_workers: bool = True
    step_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers: must be >= 1, got {self.workers}", field="workers")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}",
                field="gpu_memory_utilization",
            )
        for name in ("client_timeout_s", "worker_timeout_s", "worker_wait_s", "step_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"{name}: must be a positive number, got {value}", field=name)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(
                f"device: expected auto, cpu, cuda or cuda:N, got {self.device!r}", field="device"
            )
        for name in ("frontend", "worker_endpoint"):
            check_endpoint(name, getattr(self, name))


SERVER_FIELDS: tuple[str, ...] = ServerConfig.__struct_fields__


def check_endpoint(name: str, address: str) -> None:
    """ipc:// anywhere, tcp:// only on loopback (beyond it needs CURVE, not configured)."""
    if not address:
        return
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ConfigError(f"{name}: expected ipc://PATH or tcp://HOST:PORT, got {address!r}")
    if scheme == "tcp":
        host = rest.rsplit(":", 1)[0].strip("[]")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(
                f"{name}: {address} is not a loopback address; serving beyond loopback "
                "needs CURVE keys, which this server does not configure"
            )


def _env_value(name: str, raw: str) -> object:
    kind = ServerConfig.__annotations__[name]
    if "bool" in str(kind):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected a boolean, got {raw!r}")
    if "int" in str(kind):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if "float" in str(kind):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
    return raw


def load_server_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> ServerConfig:
    values: dict[str, object] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                table = tomllib.load(handle).get("server", {})
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {os.fspath(path)}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{os.fspath(path)}: invalid TOML: {exc}") from None
        for key in table:
            if key not in SERVER_FIELDS:
                raise ConfigError(
                    f"{os.fspath(path)}: unknown key {key!r} in [server]; valid keys: "
                    + ", ".join(SERVER_FIELDS)
                )
        values.update(table)
    env = os.environ if env is None else env
    for name in SERVER_FIELDS:
        raw = env.get(f"EXPEDITOR_{name.upper()}")
        if raw is not None:
            values[name] = _env_value(name, raw)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return msgspec.convert(values, ServerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"[server] {exc}") from None


def server_config_to_toml(cfg: ServerConfig) -> str:
    lines = ["[server]"]
    for name in SERVER_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            text = repr(value)
        lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"
