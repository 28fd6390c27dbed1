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

SUPERVISED_ENV = "EXPEDITOR_SUPERVISED"
"""Set to 1 by ``expeditor serve`` for its children: they leave Ctrl-C (SIGINT, which a
terminal sends to the whole process group) to the supervisor, which stops them in order."""

SERVER_FIELD_HELP: dict[str, str] = {
    "model": "Checkpoint directory (Hugging Face layout); empty = the embedded tiny model.",
    "frontend": "Client endpoint: ipc://PATH, or ipc://@NAME / tcp://HOST:PORT with CURVE.",
    "worker_endpoint": "Endpoint workers connect to, like frontend.",
    "workers": "Worker processes (ranks) expected; each runs every plan.",
    "device": "Worker device: auto, cpu, cuda or cuda:N.",
    "gpu_memory_utilization": "Share of GPU memory a CUDA worker may use (weights + KV cache).",
    "client_timeout_s": "A client silent this long while it has requests is gone: abort them.",
    "worker_timeout_s": "A worker silent this long (no heartbeat) is lost.",
    "worker_wait_s": "After losing every worker, requests wait this long for one, then fail.",
    "restart_workers": "serve: restart a worker that died (else its requests fail).",
    "step_timeout_s": "A worker that owes a step this long (heartbeats or not) is hung: killed.",
    "shutdown_timeout_s": "On SIGTERM, requests in flight get this long to finish; the rest fail.",
    "max_frame_bytes": "Largest client frame; a client that sends a bigger one is disconnected.",
    "max_prompt_bytes": "Longest text prompt in UTF-8 bytes (refused as bad_request beyond).",
    "curve_server_key": "CURVE: the server's certificate from `expeditor keygen` (the scheduler "
    "needs NAME.key_secret; workers and serve may give either file).",
    "curve_client_key": "CURVE: a client's secret certificate (NAME.key_secret), used by "
    "workers and by serve's health checks; its public key must be allow-listed.",
    "curve_authorized_clients": "CURVE: directory of the public certificates (*.key) that "
    "may connect; read at start.",
    "insecure_tcp": "Allow tcp:// on loopback without CURVE: ANY local user can then "
    "submit, inspect and abort requests.",
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
    shutdown_timeout_s: float = 30.0
    max_frame_bytes: int = 64 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024
    curve_server_key: str = ""
    curve_client_key: str = ""
    curve_authorized_clients: str = ""
    insecure_tcp: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers: must be >= 1, got {self.workers}", field="workers")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}",
                field="gpu_memory_utilization",
            )
        for name in (
            "client_timeout_s",
            "worker_timeout_s",
            "worker_wait_s",
            "step_timeout_s",
            "shutdown_timeout_s",
        ):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"{name}: must be a positive number, got {value}", field=name)
        for name in ("max_frame_bytes", "max_prompt_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}", field=name)
        if self.max_prompt_bytes >= self.max_frame_bytes:
            raise ConfigError(
                f"max_prompt_bytes ({self.max_prompt_bytes}) must be below max_frame_bytes "
                f"({self.max_frame_bytes})",
                field="max_prompt_bytes",
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(
                f"device: expected auto, cpu, cuda or cuda:N, got {self.device!r}", field="device"
            )
        for name, other in (
            ("curve_server_key", "curve_authorized_clients"),
            ("curve_authorized_clients", "curve_server_key"),
        ):
            if getattr(self, other) and not getattr(self, name):
                raise ConfigError(
                    f"{name}: CURVE needs both curve_server_key and curve_authorized_clients; "
                    f"{other} is set, {name} is not",
                    field=name,
                )
        if self.curve_client_key and not self.curve_server_key:
            raise ConfigError(
                "curve_client_key: set without curve_server_key (CURVE is not configured)",
                field="curve_client_key",
            )
        for name in ("frontend", "worker_endpoint"):
            check_endpoint(
                name, getattr(self, name), curve=self.curve, insecure_tcp=self.insecure_tcp
            )

    @property
    def curve(self) -> bool:
        """CURVE is configured: a server key pair and an allow-list of client keys."""
        return bool(self.curve_server_key)


SERVER_FIELDS: tuple[str, ...] = ServerConfig.__struct_fields__


SERVER_CURVE_HINT = "set curve_server_key and curve_authorized_clients"


def check_endpoint(
    name: str,
    address: str,
    *,
    curve: bool,
    insecure_tcp: bool,
    curve_hint: str = SERVER_CURVE_HINT,
) -> None:
    """An ipc:// path is guarded by file permissions; ipc://@NAME (abstract namespace, no
    permissions) and tcp:// need CURVE, except tcp:// on loopback with ``insecure_tcp``."""
    if not address:
        return
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ConfigError(
            f"{name}: expected ipc://PATH or tcp://HOST:PORT, got {address!r}", field=name
        )
    if curve:
        return
    if scheme == "ipc" and rest.startswith("@"):
        raise ConfigError(
            f"{name}: {address} is in the abstract socket namespace, which has no file "
            f"permissions (any local user could connect): it needs CURVE ({curve_hint}), "
            "or use an ipc:// socket path",
            field=name,
        )
    if scheme == "tcp":
        host = rest.rsplit(":", 1)[0].strip("[]")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(
                f"{name}: {address} is not a loopback address; serving beyond loopback "
                f"needs CURVE ({curve_hint}); insecure_tcp does not cover it",
                field=name,
            )
        if not insecure_tcp:
            raise ConfigError(
                f"{name}: {address}: tcp:// is open to every local user; it needs CURVE "
                f"({curve_hint}), or insecure_tcp = true (--insecure-tcp) to accept that "
                "any local user can submit, inspect and abort requests",
                field=name,
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
