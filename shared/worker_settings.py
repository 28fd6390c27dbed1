"""What a model runner is built from, in one struct passed whole.

A worker needs two halves of the settings: the ``[server]`` fields about the model
(:class:`~shared.server_config.ModelConfig`: checkpoint, forward, GPU memory share,
CUDA graphs, the tensor-parallel group) and the ``[scheduler]`` fields that shape a
step and the KV cache (:class:`~shared.config.StepLimits`: block size, cache blocks,
batch limits, context length). Each field is declared once, in those tables (which
:class:`~shared.server_config.ServerConfig` and :class:`~shared.config.SchedulerConfig`
inherit); :class:`WorkerSettings` holds one of each. The scheduler daemon sends it in
:class:`~ipc.schema.WorkerSetup`, ``LLM`` builds one from its keywords, and
``ModelRunner`` takes it as it is: nobody reassembles the fields one by one, so a
worker, the daemon and ``LLM`` see the same defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec
from msgspec.structs import force_setattr

from shared.config import StepLimits
from shared.config_fields import Settings, field_specs
from shared.errors import ConfigError
from shared.server_config import ModelConfig

__all__ = ["WORKER_FIELDS", "WorkerSettings", "narrow"]


_S = TypeVar("_S", bound=Settings)


def narrow(cls: type[_S], settings: _S) -> _S:
    """``settings`` (an instance of ``cls`` or of a subclass, such as a whole
    :class:`~shared.server_config.ServerConfig`) as a plain ``cls``: its fields only."""
    if type(settings) is cls:
        return settings
    return cls(**{name: getattr(settings, name) for name in field_specs(cls)})


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The worker's half of the settings: ``server`` and ``scheduler``, each the table
    part a worker uses (a whole ServerConfig / SchedulerConfig given is narrowed to it)."""

    server: ModelConfig = msgspec.field(default_factory=ModelConfig)
    scheduler: StepLimits = msgspec.field(default_factory=StepLimits)

    def __post_init__(self) -> None:
        force_setattr(self, "server", narrow(ModelConfig, self.server))
        force_setattr(self, "scheduler", narrow(StepLimits, self.scheduler))

    @classmethod
    def of(cls, fields: Mapping[str, object] | None = None, /, **more: object) -> WorkerSettings:
        """Settings with the named fields (of either half, by field name) changed from
        their declared defaults; a ConfigError for a name that is in neither."""
        values = {**(fields or {}), **more}
        unknown = sorted(set(values) - set(WORKER_FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown worker setting {unknown[0]!r}; valid: {', '.join(WORKER_FIELDS)}",
                field=unknown[0],
            )
        return cls(
            server=ModelConfig(**{n: v for n, v in values.items() if n in _SERVER}),
            scheduler=StepLimits(**{n: v for n, v in values.items() if n in _SCHEDULER}),
        )


_SERVER = frozenset(field_specs(ModelConfig))
_SCHEDULER = frozenset(field_specs(StepLimits))
WORKER_FIELDS: tuple[str, ...] = (*field_specs(ModelConfig), *field_specs(StepLimits))
"""Every field a worker is set up with, by name: ModelConfig's, then StepLimits'."""
