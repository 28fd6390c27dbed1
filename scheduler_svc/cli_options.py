"""One ``--flag`` per scheduler config field, generated from :class:`SchedulerConfig`.

Commands that take a scheduler configuration (``simulate``, later ``serve`` and
``scheduler``) are decorated with :func:`with_config_options`; they receive the flags
the user gave as ``config_overrides`` (field name -> value, ``None`` when not given),
ready for :func:`shared.config.load_config`.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Annotated, Any, get_args, get_origin

import typer

from shared.config import FIELD_HELP, SCHEDULER_FIELDS, field_type, flag_name

PANEL = "Scheduler config (also EXPEDITOR_* env vars and the [scheduler] table of --config)"


def _annotation(name: str) -> Any:
    """``Annotated[T | None, typer.Option(...)]`` for one config field."""
    declared = field_type(name)
    args = [a for a in get_args(declared) if a is not type(None)]
    base: Any = (
        args[0] if get_origin(declared) in (types.UnionType,) and len(args) == 1 else declared
    )
    flag = flag_name(name)
    help_text = FIELD_HELP[name]
    if base is bool:
        info = typer.Option(f"{flag}/--no-{flag[2:]}", help=help_text, rich_help_panel=PANEL)
        return Annotated[bool | None, info]
    info = typer.Option(flag, help=help_text, rich_help_panel=PANEL)
    return Annotated[base | None, info]


def with_config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add the scheduler config flags to a typer command taking ``config_overrides``."""
    signature = inspect.signature(func, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "config_overrides"]
    extra = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_annotation(name)
        )
        for name in SCHEDULER_FIELDS
    ]

    def command(**kwargs: Any) -> Any:
        overrides = {name: kwargs.pop(name) for name in SCHEDULER_FIELDS}
        return func(config_overrides=overrides, **kwargs)

    command.__name__ = func.__name__
    command.__doc__ = func.__doc__
    command.__signature__ = signature.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return command
