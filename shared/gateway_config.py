"""The HTTP gateway's settings: the ``[gateway]`` table, declared once (like
:mod:`shared.server_config`; loading, env vars, flags and TOML derive from the
declarations in :mod:`shared.config_fields`).

The gateway reaches the scheduler at ``[server] frontend`` with the ``[server]`` CURVE
client settings; this table holds what is its own: where it listens, its API key,
its limits and its chat template.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from msgspec import Meta

from shared.config_fields import Settings, load_settings, settings_to_toml
from shared.errors import ConfigError

ToolCallParser = Literal["hermes", "llama3_json", "mistral", "none"]
MetricsPrefix = Literal["expeditor", "vllm", "both"]

__all__ = ["GatewayConfig", "is_loopback", "load_gateway_config", "parse_http_address"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is a loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class GatewayConfig(Settings, frozen=True):
    """``expeditor gateway`` and ``expeditor serve --http``. Direct construction
    validates too."""

    TABLE: ClassVar[str] = "gateway"

    host: Annotated[
        str,
        Meta(
            description="Address to listen on; anything but loopback needs an API key "
            "(api_key or api_key_file)."
        ),
    ] = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535, description="TCP port to listen on.")] = 8000
    api_key: Annotated[
        str,
        Meta(
            description="Bearer token every request but /health and /metrics must carry "
            "(Authorization: Bearer KEY); empty = none. Prefer api_key_file or the "
            "EXPEDITOR_API_KEY variable to a flag, which other users can read in ps."
        ),
    ] = ""
    api_key_file: Annotated[
        str,
        Meta(description="File holding the API key (surrounding whitespace ignored)."),
    ] = ""
    served_model_name: Annotated[
        str,
        Meta(
            description="The model's name in the API (/v1/models, the model field); "
            "empty = the checkpoint path the scheduler serves."
        ),
    ] = ""
    chat_template: Annotated[
        str,
        Meta(
            description="A Jinja chat template file for /v1/chat/completions; empty = the "
            "checkpoint's own (tokenizer_config.json or chat_template.jinja)."
        ),
    ] = ""
    tool_call_parser: Annotated[
        ToolCallParser,
        Meta(
            description="How the model writes tool calls, read from chat outputs when "
            "a request gives tools (tool_choice auto) and enforced by a grammar for "
            "tool_choice required or a named function: hermes (<tool_call> blocks: "
            "Hermes, Qwen, most ChatML templates), llama3_json (Llama 3.1+), mistral "
            "([TOOL_CALLS]); none = tools are refused but with tool_choice none."
        ),
    ] = "hermes"
    max_body_bytes: Annotated[
        int,
        Meta(ge=1024, description="Largest request body; bigger ones get 413."),
    ] = 4 * 1024 * 1024
    scheduler_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="The scheduler silent this long while requests wait: they fail "
            "with 503 (and /health says 503).",
        ),
    ] = 10.0
    max_batch_prompts: Annotated[
        int,
        Meta(
            ge=1,
            description="Most prompts in one /v1/completions batch (a list of prompts); "
            "more get 400.",
        ),
    ] = 256
    max_batch_choices: Annotated[
        int,
        Meta(
            ge=1,
            description="Most choices in one response: n times the number of prompts; "
            "more get 400.",
        ),
    ] = 1024
    max_response_tokens: Annotated[
        int,
        Meta(
            ge=1,
            description="Most tokens one response may carry, estimated before any work: "
            "choices x (echoed prompt tokens + max_tokens), each generated token counted "
            "2 + logprobs times when logprobs are asked for, an echoed text prompt one "
            "token per 4 bytes; more get 400.",
        ),
    ] = 1024 * 1024
    max_messages: Annotated[
        int,
        Meta(ge=1, description="Most messages in one chat request; more get 400."),
    ] = 2048
    render_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Longest a chat template may take to render one request's "
            "messages (off the event loop); longer ones get 400.",
        ),
    ] = 5.0
    max_stream_buffer_bytes: Annotated[
        int,
        Meta(
            ge=65536,
            description="Most bytes a stream may hold unsent (a client that does not "
            "read): beyond it the request is aborted, with a logged reason and an error "
            "event ending the stream.",
        ),
    ] = 16 * 1024 * 1024
    header_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="A connection's request head (request line and headers) must "
            "arrive within this many seconds of the connection opening or of the previous "
            "response; else 408 and the connection is closed (slow-header clients).",
        ),
    ] = 10.0
    body_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="A request body must arrive within this many seconds of its head; "
            "else 408 and the connection is closed (slow-body clients).",
        ),
    ] = 30.0
    send_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="A client that takes nothing of its response for this many "
            "seconds (its socket buffer full) has its connection closed and its request "
            "aborted (slow-read clients).",
        ),
    ] = 30.0
    max_header_bytes: Annotated[
        int,
        Meta(
            ge=1024,
            le=16 * 1024 * 1024,
            description="Largest request head (request line and headers), counted as the "
            "bytes arrive; a bigger one gets 431 and the connection is closed.",
        ),
    ] = 64 * 1024
    max_header_count: Annotated[
        int,
        Meta(ge=8, le=10_000, description="Most header lines in a request; more get 431."),
    ] = 100
    max_connections: Annotated[
        int,
        Meta(
            ge=1,
            description="Most open HTTP connections; one beyond gets 503 and is closed at "
            "once. Must fit under the open-file limit (LimitNOFILE=) with 64 to spare: "
            "the gateway raises its soft limit up to the hard one, else refuses to start.",
        ),
    ] = 1000
    metrics_interval_s: Annotated[
        float,
        Meta(
            ge=0,
            description="/metrics is rendered from a snapshot of the scheduler's numbers "
            "taken at most this often (concurrent scrapes share one query); a request "
            "through this gateway finishing refreshes it. 0 = a query per scrape.",
        ),
    ] = 1.0
    api_docs: Annotated[
        bool,
        Meta(
            description="Serve /openapi.json, /docs and /redoc (behind the API key when "
            "one is set); off by default."
        ),
    ] = False
    min_client_priority: Annotated[
        int,
        Meta(
            description="The most urgent priority a client may ask for (lower values are "
            "served first under --policy priority); a lower one gets 400 naming priority. "
            "0 = clients may only ask for less urgency than the default.",
        ),
    ] = 0
    replica_frontends: Annotated[
        str,
        Meta(
            description="Data-parallel replicas to balance across: their schedulers' "
            "frontends, comma-separated (serve --data-parallel-size sets it); empty = "
            "[server] frontend alone.",
        ),
    ] = ""
    replica_kv_events: Annotated[
        str,
        Meta(
            description="With replica_frontends: each replica's kv_events_endpoint, "
            "comma-separated in the same order, for prefix affinity (a request goes to the "
            "replica caching most of its prompt unless it is much busier); empty = least "
            "loaded alone.",
        ),
    ] = ""
    metrics_prefix: Annotated[
        MetricsPrefix,
        Meta(
            description="The prefix of /metrics' names: expeditor (expeditor:...), vllm "
            "(vllm:..., what routers, dashboards and autoscaling rules written for vLLM "
            "read) or both.",
        ),
    ] = "expeditor"
    ssl_certfile: Annotated[
        str,
        Meta(
            description="Serve HTTPS with this PEM certificate (chain) file; with "
            "ssl_keyfile. Empty = plain HTTP.",
        ),
    ] = ""
    ssl_keyfile: Annotated[str, Meta(description="The PEM private key of ssl_certfile.")] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            missing = "ssl_keyfile" if self.ssl_certfile else "ssl_certfile"
            raise ConfigError(
                f"{missing}: HTTPS needs both ssl_certfile and ssl_keyfile", field=missing
            )
        frontends, events = self.replica_list, self.replica_kv_event_list
        if events and len(events) != len(frontends):
            raise ConfigError(
                f"replica_kv_events: {len(events)} endpoints for {len(frontends)} "
                "replica_frontends (one per replica, in the same order)",
                field="replica_kv_events",
            )
        if not self.host:
            raise ConfigError("host: must not be empty", field="host")
        if self.api_key and self.api_key_file:
            raise ConfigError("api_key: give api_key or api_key_file, not both", field="api_key")
        if not is_loopback(self.host) and not (self.api_key or self.api_key_file):
            raise ConfigError(
                f"host: {self.host} is reachable from other machines; set an API key "
                "(api_key_file, or the EXPEDITOR_API_KEY variable) or listen on 127.0.0.1",
                field="host",
            )

    @property
    def replica_list(self) -> list[str]:
        return [f.strip() for f in self.replica_frontends.split(",") if f.strip()]

    @property
    def replica_kv_event_list(self) -> list[str]:
        return [e.strip() for e in self.replica_kv_events.split(",") if e.strip()]

    def read_api_key(self) -> str | None:
        """The API key, read from ``api_key_file`` if that is set; None = no key."""
        if self.api_key_file:
            try:
                key = open(self.api_key_file, encoding="utf-8").read().strip()
            except OSError as exc:
                raise ConfigError(
                    f"api_key_file: cannot read {self.api_key_file}: {exc.strerror}",
                    field="api_key_file",
                ) from None
            if not key:
                raise ConfigError(
                    f"api_key_file: {self.api_key_file} is empty", field="api_key_file"
                )
            return key
        return self.api_key or None


def parse_http_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ConfigError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--http: expected HOST:PORT, e.g. 127.0.0.1:8000, got {text!r}")
    return host.strip("[]"), int(port)


def load_gateway_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> GatewayConfig:
    """The gateway settings from file, environment and flags (flags > env > file)."""
    return load_settings(GatewayConfig, path, env=env, overrides=overrides)


def gateway_config_to_toml(cfg: GatewayConfig) -> str:
    """``cfg`` as a commented ``[gateway]`` table."""
    return settings_to_toml(cfg)
