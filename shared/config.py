"""Scheduler configuration: the ``[scheduler]`` table, declared once.

Each field's type, default, bounds and help live in its declaration below; checking,
the ``[scheduler]`` TOML table, ``EXPEDITOR_<FIELD>`` environment variables, the
``--field-name`` flags and :func:`config_to_toml` all derive from it
(:mod:`shared.config_fields`). Values are layered flags > env > file > defaults, and
an error names the field and the layer it came from. Other TOML tables and
``EXPEDITOR_*`` variables that name no scheduler field belong to other components and
are ignored here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from msgspec import Meta

from shared.config_fields import (
    Check,
    Settings,
    env_var_name,
    flag_name,
    help_texts,
    load_settings,
    settings_to_toml,
)
from shared.errors import ConfigError

__all__ = [
    "FIELD_HELP",
    "SCHEDULER_FIELDS",
    "SchedulerConfig",
    "StepLimits",
    "config_to_toml",
    "env_var_name",
    "flag_name",
    "load_config",
]

PreemptionSetting = Literal["auto", "swap", "recompute"]
QueuePolicy = Literal["fcfs", "priority"]

_POWER_OF_TWO = Check(lambda n: n & (n - 1) == 0, "a power of two between 1 and 256")


class StepLimits(Settings, frozen=True):
    """The ``[scheduler]`` fields the workers are set up with too: the shape of a step
    and of the KV cache, which a worker sizes its cache, buffers and CUDA graphs by.
    :class:`SchedulerConfig` inherits them; a worker gets them inside
    :class:`shared.worker_settings.WorkerSettings`."""

    TABLE: ClassVar[str] = "scheduler"

    block_size: Annotated[
        int,
        Meta(ge=1, le=256, description="Tokens per KV cache block (power of two, 1..256)."),
        _POWER_OF_TWO,
    ] = 16
    num_gpu_blocks: (
        Annotated[
            int,
            Meta(
                ge=1, description="KV blocks per GPU worker; unset = sized from the workers' hello."
            ),
        ]
        | None
    ) = None
    max_num_seqs: Annotated[int, Meta(ge=1, description="Most requests running in one step.")] = 256
    max_num_batched_tokens: Annotated[
        int,
        Meta(ge=1, description="Token budget of one forward step (prefill chunks + decodes)."),
    ] = 8192
    max_model_len: Annotated[
        int,
        Meta(ge=2, description="Longest context (prompt + generated tokens) a request may reach."),
    ] = 4096
    num_speculative_tokens: Annotated[
        int,
        Meta(
            ge=0,
            le=16,
            description="Tokens proposed per sequence and step by prompt lookup (n-gram), "
            "or by the draft model when speculative_model is set, verified in one "
            "forward; 0 = no speculative decoding.",
        ),
    ] = 0
    free_out_of_window_blocks: Annotated[
        bool,
        Meta(
            description="Give back each sequence's KV blocks of its sliding-window "
            "layers once the window has passed them (they are never read again): a "
            "model whose every layer is windowed gives back whole blocks, one that "
            "mixes windowed and full layers lays its cache out in layer groups and gives "
            "back the windowed groups' (block counts still mean blocks of every layer: "
            "the pools hold as many bytes in blocks of one group's layers); off = a "
            "sequence holds its whole context in every layer."
        ),
    ] = True


class SchedulerConfig(StepLimits, frozen=True):
    """Knobs of the scheduler daemon, one line of help on each (the first ones, which
    the workers need too, declared in :class:`StepLimits`).

    Direct construction validates too: a wrong type or out-of-range value raises
    :class:`ConfigError` naming the field. Integer values given for float fields are
    stored as floats.
    """

    num_cpu_blocks: Annotated[
        int,
        Meta(ge=0, description="Blocks in the CPU swap pool (pinned shared memory); 0 = no swap."),
    ] = 0
    prefix_cache_cpu_blocks: Annotated[
        int,
        Meta(
            ge=0,
            description="Of num_cpu_blocks, blocks that keep prefix-cache blocks evicted "
            "from the device (the host tier), copied back on a prefix hit instead of "
            "recomputed; 0 = evicted prefixes are dropped.",
        ),
    ] = 0
    long_prefill_token_threshold: Annotated[
        int, Meta(ge=0, description="Cap on one request's prefill chunk per step; 0 = off.")
    ] = 0
    watermark: Annotated[
        float,
        Meta(
            ge=0, lt=1, description="Fraction of GPU blocks held back from admission (0 <= w < 1)."
        ),
    ] = 0.01
    preemption_mode: Annotated[
        PreemptionSetting,
        Meta(description="How victims give up KV: auto (cost model), swap or recompute."),
    ] = "auto"
    policy: Annotated[
        QueuePolicy,
        Meta(
            description="Waiting-queue order: fcfs, or priority (FIFO within a priority, "
            "with aging)."
        ),
    ] = "fcfs"
    aging_rate: Annotated[
        float, Meta(ge=0, description="Priority units a waiting request gains per step waited.")
    ] = 0.01
    fair_share: Annotated[
        bool,
        Meta(
            description="Round-robin admission among clients at equal priority; off = strict "
            "arrival order."
        ),
    ] = True
    cache_aware_admission: Annotated[
        bool,
        Meta(
            description="Admit the waiting request with the longest cached prefix first "
            "(within a priority under the priority policy), and hold back one whose next "
            "uncached block a running prefill is still to compute; none is passed over "
            "more than max_bypass times. Needs enable_prefix_caching to matter.",
        ),
    ] = False
    max_bypass: Annotated[
        int,
        Meta(
            ge=0,
            description="Cache-aware admission: how many times a waiting request may be "
            "passed over for one that arrived after it before it goes first.",
        ),
    ] = 4
    max_preemptions: Annotated[
        int,
        Meta(
            ge=1,
            description="Preemptions after which a request is no longer picked as a victim "
            "while others can be.",
        ),
    ] = 8
    max_waiting_requests: Annotated[
        int,
        Meta(
            ge=1,
            description="Waiting-queue length beyond which requests are refused as overloaded.",
        ),
    ] = 4096
    enable_prefix_caching: Annotated[
        bool, Meta(description="Share KV blocks of identical prompt prefixes across requests.")
    ] = True
    overlap_scheduling: Annotated[
        bool,
        Meta(
            description="Plan each step while the workers run the one before (a token "
            "not back yet is a placeholder they fill in); off = wait for each result."
        ),
    ] = True
    speculative_backoff: Annotated[
        bool,
        Meta(
            description="Stop proposing while the measured gain (accepted tokens) does not "
            "pay for the tokens verified (one step in 32 still proposes); off = always "
            "propose.",
        ),
    ] = True
    prompt_lookup_min: Annotated[
        int,
        Meta(
            ge=1,
            le=16,
            description="Shortest suffix of a sequence that prompt lookup matches against "
            "its earlier tokens.",
        ),
    ] = 2
    prompt_lookup_max: Annotated[
        int,
        Meta(
            ge=1,
            le=16,
            description="Longest suffix prompt lookup tries first (the longest match wins).",
        ),
    ] = 4
    swap_bandwidth_gbps: Annotated[
        float,
        Meta(
            gt=0,
            description="Host<->device copy bandwidth (GB/s) assumed by the swap cost model.",
        ),
    ] = 16.0
    prefill_tokens_per_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Prefill throughput (tokens/s) assumed by the recompute cost model.",
        ),
    ] = 20000.0
    swap_overhead_ms: Annotated[
        float,
        Meta(
            ge=0,
            description="Fixed cost (ms) of one swap-out/swap-in round trip in the cost model.",
        ),
    ] = 0.5
    max_queued_per_user: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="Most unfinished requests (waiting or running) one user may "
                "have: a client, or an end user a gateway names; beyond, overloaded (429). "
                "Unset = a quarter of max_waiting_requests.",
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefix_cache_cpu_blocks > self.num_cpu_blocks:
            raise ConfigError(
                f"prefix_cache_cpu_blocks: must be <= num_cpu_blocks ({self.num_cpu_blocks}), "
                f"got {self.prefix_cache_cpu_blocks}",
                field="prefix_cache_cpu_blocks",
            )
        if self.prefix_cache_cpu_blocks and not self.enable_prefix_caching:
            raise ConfigError(
                "prefix_cache_cpu_blocks: the host tier needs enable_prefix_caching",
                field="prefix_cache_cpu_blocks",
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min: must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min}",
                field="prompt_lookup_min",
            )

    @property
    def user_queue_cap(self) -> int:
        """``max_queued_per_user``, or its default when unset: a quarter of the queue."""
        if self.max_queued_per_user is not None:
            return self.max_queued_per_user
        return max(1, self.max_waiting_requests // 4)

    def watermark_blocks(self, num_gpu_blocks: int) -> int:
        """GPU blocks held back from admission out of a pool of ``num_gpu_blocks``."""
        return int(self.watermark * num_gpu_blocks)


SCHEDULER_FIELDS: tuple[str, ...] = SchedulerConfig.__struct_fields__
FIELD_HELP: dict[str, str] = help_texts(SchedulerConfig)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> SchedulerConfig:
    """The scheduler configuration from file, environment and flags; see
    :func:`shared.config_fields.load_settings`."""
    return load_settings(SchedulerConfig, path, env=env, overrides=overrides)


def config_to_toml(cfg: SchedulerConfig) -> str:
    """``cfg`` as a commented ``[scheduler]`` table that :func:`load_config` reads back."""
    return settings_to_toml(cfg)
