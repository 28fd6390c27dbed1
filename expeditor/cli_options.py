"""Command-line flags generated from the settings declarations, one ``--flag`` per field.

:func:`settings_options` adds a flag for each field of a :class:`Settings` table, with
the type and help text of the field's declaration; the command receives the flags given
in one parameter (field name -> value, ``None`` when not given), ready to be passed as
``overrides`` to :func:`shared.config_fields.load_settings`. Commands that take the
scheduler configuration are decorated with :func:`with_config_options`
(``config_overrides``, for :func:`shared.config.load_config`), those that take
``[server]`` fields with :func:`with_server_options` (``server_overrides``, for
:func:`shared.server_config.load_server_config`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import typer

from shared.config import SchedulerConfig
from shared.config_fields import Settings, field_spec, flag_name
from shared.server_config import SERVER_FIELDS, ServerConfig

CONFIG_PANEL = "Scheduler config (also EXPEDITOR_* env vars and the [scheduler] table of --config)"
SERVER_PANEL = "Server (also EXPEDITOR_* env vars and the [server] table of --config)"

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _annotation(cls: type[Settings], name: str, panel: str) -> Any:
    """``Annotated[T | None, typer.Option(...)]`` for one field, from its declaration."""
    spec = field_spec(cls, name)
    flag = flag_name(name)
    if spec.kind is bool:
        info = typer.Option(f"{flag}/--no-{flag[2:]}", help=spec.help, rich_help_panel=panel)
        return Annotated[bool | None, info]
    info = typer.Option(flag, help=spec.help, rich_help_panel=panel)
    return Annotated[spec.value_type | None, info]


def settings_options(
    cls: type[Settings], param: str, panel: str, fields: Iterable[str] | None = None
) -> Decorator:
    """Add flags for ``fields`` of ``cls`` (default: all) to a typer command that takes
    them as ``param``; the flags are listed under ``panel`` in ``--help``."""
    names = tuple(cls.__struct_fields__ if fields is None else fields)
    annotations = {name: _annotation(cls, name, panel) for name in names}

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != param]
        extra = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=a)
            for n, a in annotations.items()
        ]

        def command(**kwargs: Any) -> Any:
            overrides = {n: kwargs.pop(n) for n in names}
            return func(**{param: overrides}, **kwargs)

        command.__name__ = func.__name__
        command.__doc__ = func.__doc__
        command.__signature__ = signature.replace(parameters=own + extra)  # type: ignore[attr-defined]
        return command

    return decorate


with_config_options: Decorator = settings_options(SchedulerConfig, "config_overrides", CONFIG_PANEL)
"""Add the scheduler config flags to a typer command taking ``config_overrides``."""


def with_server_options(fields: Iterable[str] = SERVER_FIELDS) -> Decorator:
    """Add flags for ``fields`` of the [server] table to a command taking ``server_overrides``."""
    return settings_options(ServerConfig, "server_overrides", SERVER_PANEL, fields)


GATEWAY_PANEL = "Gateway (also EXPEDITOR_* env vars and the [gateway] table of --config)"


def with_gateway_options(fields: Iterable[str] | None = None) -> Decorator:
    """Add flags for ``fields`` of the [gateway] table to a command taking
    ``gateway_overrides``."""
    from shared.gateway_config import GatewayConfig

    return settings_options(GatewayConfig, "gateway_overrides", GATEWAY_PANEL, fields)
