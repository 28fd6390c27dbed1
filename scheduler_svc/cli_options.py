"""Command-line flags generated from the config structs, one ``--flag`` per field.

Commands that take the scheduler configuration are decorated with
:func:`with_config_options` and receive the flags given as ``config_overrides`` (field
name -> value, ``None`` when not given), ready for :func:`shared.config.load_config`.
:func:`with_server_options` does the same for the ``[server]`` fields
(``server_overrides``, for :func:`shared.server_config.load_server_config`).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import typer

from shared.config import FIELD_HELP, SCHEDULER_FIELDS, field_type
from shared.server_config import SERVER_FIELD_HELP, SERVER_FIELDS, ServerConfig

CONFIG_PANEL = "Scheduler config (also EXPEDITOR_* env vars and the [scheduler] table of --config)"
SERVER_PANEL = "Server (also EXPEDITOR_* env vars and the [server] table of --config)"


def _base_type(declared: Any) -> Any:
    """``int`` for ``int | None``; ``str`` for a union of literals and str."""
    args = [a for a in get_args(declared) if a is not type(None)]
    if get_origin(declared) in (types.UnionType, Union):
        return args[0] if len(args) == 1 else str
    return declared


def _annotation(name: str, declared: Any, help_text: str, panel: str) -> Any:
    """``Annotated[T | None, typer.Option(...)]`` for one field."""
    base = _base_type(declared)
    flag = "--" + name.replace("_", "-")
    if base is bool:
        info = typer.Option(f"{flag}/--no-{flag[2:]}", help=help_text, rich_help_panel=panel)
        return Annotated[bool | None, info]
    info = typer.Option(flag, help=help_text, rich_help_panel=panel)
    return Annotated[base | None, info]


def _with_options(
    func: Callable[..., Any],
    param: str,
    fields: Iterable[str],
    annotation: Callable[[str], Any],
) -> Callable[..., Any]:
    names = tuple(fields)
    signature = inspect.signature(func, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != param]
    extra = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation(n))
        for n in names
    ]

    def command(**kwargs: Any) -> Any:
        overrides = {n: kwargs.pop(n) for n in names}
        return func(**{param: overrides}, **kwargs)

    command.__name__ = func.__name__
    command.__doc__ = func.__doc__
    command.__signature__ = signature.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return command


def with_config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add the scheduler config flags to a typer command taking ``config_overrides``."""
    return _with_options(
        func,
        "config_overrides",
        SCHEDULER_FIELDS,
        lambda n: _annotation(n, field_type(n), FIELD_HELP[n], CONFIG_PANEL),
    )


def with_server_options(
    fields: Iterable[str] = SERVER_FIELDS,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add flags for ``fields`` of the [server] table to a command taking ``server_overrides``."""
    hints = get_type_hints(ServerConfig)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        return _with_options(
            func,
            "server_overrides",
            fields,
            lambda n: _annotation(n, hints[n], SERVER_FIELD_HELP[n], SERVER_PANEL),
        )

    return decorate
