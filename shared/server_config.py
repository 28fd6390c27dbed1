"""The daemons' own settings: the ``[server]`` table, declared once.

As for the scheduler config (:mod:`shared.config`), each field's type, default, bounds
and help live in its declaration; the TOML table, ``EXPEDITOR_<FIELD>`` env vars, flags
and :func:`server_config_to_toml` derive from it (:mod:`shared.config_fields`). Rules
that tie fields together (CURVE settings, endpoints, frame and prompt limits) are
checked in ``__post_init__``.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from msgspec import Meta

from shared.config_fields import Check, Settings, load_settings, settings_to_toml
from shared.errors import ConfigError

SUPERVISED_ENV = "EXPEDITOR_SUPERVISED"
"""Set to 1 by ``expeditor serve`` for its children: they leave Ctrl-C (SIGINT, which a
terminal sends to the whole process group) to the supervisor, which stops them in order."""

_DEVICE = Check(
    lambda device: device in ("auto", "cpu", "cuda") or device.startswith("cuda:"),
    "auto, cpu, cuda or cuda:N",
)


def _seconds(description: str) -> Meta:
    """A duration: a positive (finite) number of seconds."""
    return Meta(gt=0, description=description)


ModelImpl = Literal["auto", "transformers"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "int8", "fp8_e4m3", "fp8_e5m2"]


class ModelConfig(Settings, frozen=True):
    """The ``[server]`` fields every worker is set up with (the scheduler sends them in
    :class:`~shared.worker_settings.WorkerSettings`): the checkpoint, how it runs and
    the tensor-parallel group. :class:`ServerConfig` inherits them."""

    TABLE: ClassVar[str] = "server"

    model: Annotated[
        str,
        Meta(
            description="Checkpoint: a Hugging Face directory, a GGUF file (or a directory "
            "holding one; converted once to safetensors in the cache), a registry model "
            "name (smollm2-135m-instruct), or empty = the embedded tiny model."
        ),
    ] = ""
    speculative_model: Annotated[
        str,
        Meta(
            description="Draft model of speculative decoding (a checkpoint as for model, "
            "with the same tokenizer): the workers draft each speculating decode's "
            "num_speculative_tokens with it, its K/V beside the model's in every block. "
            "Empty = prompt lookup proposes. Not with tensor_parallel_size > 1.",
        ),
    ] = ""
    dtype: Annotated[
        ModelDtype,
        Meta(
            description="Weights' and KV cache's dtype: auto = bfloat16 on CUDA and on "
            "CPUs with AVX-512 BF16 or AMX, float32 elsewhere (the sampler computes in "
            "float32 always)."
        ),
    ] = "auto"
    kv_cache_dtype: Annotated[
        KVCacheDtype,
        Meta(
            description="KV cache's storage: auto = the model's dtype; int8, fp8_e4m3 or "
            "fp8_e5m2 = 8-bit codes with a float16 scale per token and KV head (about "
            "twice the tokens per byte of a 16-bit cache; the attention reads them "
            "dequantized: the Triton kernels on CUDA; on a CPU the native kernel for int8, "
            "the torch backend for fp8).",
        ),
    ] = "auto"
    gpu_memory_utilization: Annotated[
        float,
        Meta(
            gt=0,
            le=1,
            description="Share of GPU memory a CUDA worker may use (weights + KV cache).",
        ),
    ] = 0.9
    cuda_graphs: Annotated[
        bool,
        Meta(
            description="CUDA workers capture decode-only steps as CUDA graphs at start-up, "
            "one per batch-size bucket up to max_num_seqs (false: every step eager). "
            "Ignored off CUDA.",
        ),
    ] = True
    model_impl: Annotated[
        ModelImpl,
        Meta(
            description="The workers' forward: auto = expeditor's lean forward for "
            "llama, mistral, qwen2 and qwen3 checkpoints on every device and "
            "tensor-parallel degree (the same function in fewer operations) and "
            "transformers' model code for the other architectures; transformers = "
            "transformers' model code always.",
        ),
    ] = "auto"
    tensor_parallel_size: Annotated[
        int,
        Meta(
            ge=1,
            description="Ranks that together hold one copy of the model, each 1/N of its "
            "attention heads, KV heads and MLP (one torch.distributed group: gloo on CPU, "
            "NCCL on CUDA).",
        ),
    ] = 1
    dist_master_addr: Annotated[
        str,
        Meta(
            description="Rendezvous of the tensor-parallel group: the address where rank 0 "
            "listens (reachable from every rank's machine)."
        ),
    ] = "127.0.0.1"
    dist_master_port: Annotated[
        int,
        Meta(
            ge=0,
            le=65535,
            description="Rendezvous port on dist_master_addr; 0 = serve picks a free one "
            "(workers started on their own need it set).",
        ),
    ] = 0


class ServerConfig(ModelConfig, frozen=True):
    """Endpoints, workers, timeouts, limits and CURVE keys of ``serve``, the scheduler
    and the workers (the workers' model settings declared in :class:`ModelConfig`).
    Direct construction validates too, like :class:`SchedulerConfig`."""

    frontend: Annotated[
        str,
        Meta(
            description="Client endpoint: ipc://PATH, or ipc://@NAME / tcp://HOST:PORT with CURVE."
        ),
    ] = ""
    worker_endpoint: Annotated[
        str, Meta(description="Endpoint workers connect to, like frontend.")
    ] = ""
    workers: Annotated[
        int,
        Meta(
            ge=1,
            description="Worker processes (ranks) expected: 1, or with tensor_parallel_size "
            "N, N (1 also means N). More replicas are data_parallel_size, not workers.",
        ),
    ] = 1
    device: Annotated[
        str, Meta(description="Worker device: auto, cpu, cuda or cuda:N."), _DEVICE
    ] = "auto"
    cpu_threads: Annotated[
        int,
        Meta(
            ge=0,
            description="Torch threads of a CPU worker; 0 = chosen at start-up by timing a "
            "decode forward: every core if that is at least 1.15x faster than all but one, "
            "else all but one (a core for the scheduler).",
        ),
    ] = 0
    client_timeout_s: Annotated[
        float, _seconds("A client silent this long while it has requests is gone: abort them.")
    ] = 10.0
    worker_timeout_s: Annotated[
        float, _seconds("A worker silent this long (no heartbeat) is lost.")
    ] = 5.0
    worker_wait_s: Annotated[
        float, _seconds("After losing every worker, requests wait this long for one, then fail.")
    ] = 60.0
    restart_workers: Annotated[
        bool, Meta(description="serve: restart a worker that died (else its requests fail).")
    ] = True
    step_timeout_s: Annotated[
        float, _seconds("A worker that owes a step this long (heartbeats or not) is hung: killed.")
    ] = 600.0
    shutdown_timeout_s: Annotated[
        float,
        _seconds("On SIGTERM, requests in flight get this long to finish; the rest fail."),
    ] = 30.0
    max_frame_bytes: Annotated[
        int,
        Meta(
            ge=1,
            description="Largest client frame; a client that sends a bigger one is disconnected.",
        ),
    ] = 64 * 1024 * 1024
    max_prompt_bytes: Annotated[
        int,
        Meta(
            ge=1,
            description="Longest text prompt in UTF-8 bytes (refused as bad_request beyond).",
        ),
    ] = 1024 * 1024
    grammar_compile_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Longest a request's structured output (schema, regex, choices, "
            "grammar) may take to compile; beyond, the request is refused as bad_request.",
        ),
    ] = 10.0
    curve_server_key: Annotated[
        str,
        Meta(
            description="CURVE: the server's certificate from `expeditor keygen` (the scheduler "
            "needs NAME.key_secret; workers and serve may give either file)."
        ),
    ] = ""
    curve_client_key: Annotated[
        str,
        Meta(
            description="CURVE: a client's secret certificate (NAME.key_secret), used by "
            "workers and by serve's health checks; its public key must be allow-listed."
        ),
    ] = ""
    curve_authorized_clients: Annotated[
        str,
        Meta(
            description="CURVE: directory of the public certificates (*.key) that may "
            "connect; read at start."
        ),
    ] = ""
    insecure_tcp: Annotated[
        bool,
        Meta(
            description="Allow tcp:// on loopback without CURVE: ANY local user can then "
            "submit, inspect and abort requests."
        ),
    ] = False
    max_reply_backlog_bytes: Annotated[
        int,
        Meta(
            ge=1,
            description="Replies held back for one client whose pipe is full (it reads "
            "nothing), in bytes; beyond, they are dropped (the client sees the gap) and its "
            "requests aborted.",
        ),
    ] = 256 * 1024 * 1024

    data_parallel_size: Annotated[
        int,
        Meta(
            ge=1,
            description="serve: replicas to start, each its own scheduler, KV pool and "
            "workers (tensor_parallel_size ranks; on CUDA its own GPUs, CUDA_VISIBLE_DEVICES "
            "split), the gateway balancing requests across them (least loaded, with prefix "
            "affinity from their KV events).",
        ),
    ] = 1
    data_parallel_rank: Annotated[
        int,
        Meta(
            ge=0,
            description="This replica's index among data-parallel replicas (serve sets it): "
            "its KV events carry it as dp_rank.",
        ),
    ] = 0
    kv_events_endpoint: Annotated[
        str,
        Meta(
            description="Publish the prefix cache's KV events here (a ZeroMQ PUB socket, "
            "vLLM's wire format, for KV-aware routers): tcp://HOST:PORT or ipc://PATH; "
            "empty = off. The stream carries prompt token ids and has no authentication: "
            "bind it where only the routers reach it.",
        ),
    ] = ""
    kv_events_connect: Annotated[
        bool,
        Meta(
            description="Connect the KV events' PUB socket to kv_events_endpoint (a "
            "subscriber that binds it, as llm-d's endpoint picker) instead of binding it.",
        ),
    ] = False
    kv_events_replay_endpoint: Annotated[
        str,
        Meta(
            description="With kv_events_endpoint: a ROUTER socket here resends the batches "
            "a subscriber missed, from a sequence number (empty = no replay).",
        ),
    ] = ""
    kv_events_topic: Annotated[
        str,
        Meta(
            description="The KV events' topic frame (llm-d's indexer expects "
            "kv@POD_IP:PORT@MODEL; empty = none, as vLLM's default).",
        ),
    ] = ""
    kv_events_buffer_steps: Annotated[
        int,
        Meta(ge=1, description="KV event batches kept for the replay socket."),
    ] = 10_000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tensor_parallel_size == 1 and self.workers > 1:
            raise ConfigError(
                f"workers: {self.workers} workers without tensor parallelism would each run "
                f"every plan (mirrors: {self.workers}x the compute for one replica's "
                f"throughput). For {self.workers} replicas give data_parallel_size = "
                f"{self.workers} (serve --data-parallel-size {self.workers}); to split the "
                f"model over {self.workers} ranks, tensor_parallel_size = {self.workers}",
                field="workers",
            )
        if self.tensor_parallel_size > 1 and self.workers not in (1, self.tensor_parallel_size):
            raise ConfigError(
                f"workers: with tensor_parallel_size {self.tensor_parallel_size} the workers "
                f"are the group's ranks: give {self.tensor_parallel_size} (or leave it at 1), "
                f"got {self.workers}",
                field="workers",
            )
        if self.max_prompt_bytes >= self.max_frame_bytes:
            raise ConfigError(
                f"max_prompt_bytes ({self.max_prompt_bytes}) must be below max_frame_bytes "
                f"({self.max_frame_bytes})",
                field="max_prompt_bytes",
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
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            address = getattr(self, name)
            if address and address.partition("://")[0] not in ("ipc", "tcp"):
                raise ConfigError(
                    f"{name}: expected tcp://HOST:PORT or ipc://PATH, got {address!r}",
                    field=name,
                )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError(
                "kv_events_replay_endpoint: set without kv_events_endpoint (no events to replay)",
                field="kv_events_replay_endpoint",
            )

    @property
    def num_ranks(self) -> int:
        """Worker processes the scheduler waits for: the tensor-parallel group's ranks."""
        return self.tensor_parallel_size

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


def load_server_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> ServerConfig:
    """The server settings from file, environment and flags; see
    :func:`shared.config_fields.load_settings`."""
    return load_settings(ServerConfig, path, env=env, overrides=overrides)


def server_config_to_toml(cfg: ServerConfig) -> str:
    """``cfg`` as a commented ``[server]`` table that :func:`load_server_config` reads back."""
    return settings_to_toml(cfg)
