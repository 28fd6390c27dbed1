"""Chat messages to a prompt: the checkpoint's Jinja chat template, rendered as
transformers' ``apply_chat_template`` renders it (a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now`` and a
``tojson`` that keeps non-ASCII), without loading transformers into the gateway.

The template comes from ``--chat-template FILE``, else the checkpoint's
``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or
a list of named templates of which ``default`` is used).

What a request may cost: at most ``max_messages`` messages (checked before rendering);
``chat_template_kwargs`` may add variables but not shadow the ones the template is given
(:data:`RESERVED_NAMES`: the messages, the special tokens, the template's functions),
so a request cannot make the template repeat a large ``bos_token`` per message; the
prompt is checked against ``max_prompt_bytes`` while it is rendered (piece by piece),
and rendering runs on a thread (unless the conversation is short) with a time bound,
``render_timeout_s``. Each is a 400 naming the limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from expeditor.gateway.protocol import GatewayRequestError

__all__ = ["RESERVED_NAMES", "ChatTemplate", "load_chat_template", "render_messages"]

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")

RESERVED_NAMES = frozenset(
    {
        *_SPECIAL,
        "sep_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "tool_choice",
        # the template's functions and Jinja's own globals
        "raise_exception",
        "strftime_now",
        "range",
        "dict",
        "lipsum",
        "cycler",
        "joiner",
        "namespace",
    }
)
"""Names ``chat_template_kwargs`` may not set (400 naming the key)."""

INLINE_RENDER_MESSAGES = 16
"""Conversations up to this many messages are rendered on the event loop (fast)."""


def _raise(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.source)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
        max_bytes: int | None = None,
        timeout_s: float | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text; a bad message or a template error is a 400, and so is a
        prompt over ``max_bytes`` (checked as it grows) or a render still going after
        ``timeout_s``. ``tools`` reach the template as transformers passes them (None
        when the request has none)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        checked = [_check_message(index, m) for index, m in enumerate(messages)]
        if continue_final_message and add_generation_prompt:
            raise GatewayRequestError(
                "continue_final_message: cannot be combined with add_generation_prompt",
                param="continue_final_message",
            )
        _check_kwargs(extra)
        context = {**self.special_tokens, **(extra or {})}
        pieces: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(
                messages=checked,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **context,
            ):
                pieces.append(piece)
                size += len(piece)  # characters: at most the UTF-8 bytes
                if max_bytes is not None and size > max_bytes:
                    raise GatewayRequestError(
                        f"messages: the rendered prompt is over {size} characters; this "
                        f"server takes at most max_prompt_bytes={max_bytes}",
                        param="messages",
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise _too_slow(timeout_s)
        except GatewayRequestError:
            raise
        except jinja2.exceptions.TemplateError as exc:
            raise GatewayRequestError(f"messages: the chat template refused them: {exc}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, RecursionError) as exc:
            # Values from chat_template_kwargs or the messages the template cannot use.
            raise GatewayRequestError(
                f"messages: the chat template failed on this request: {exc}", param="messages"
            ) from None
        text = "".join(pieces)
        if continue_final_message:
            final = checked[-1].get("content") or ""
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise GatewayRequestError(
                    "continue_final_message: the final message is not in the rendered prompt",
                    param="continue_final_message",
                )
            text = text[: cut + len(final)]
        return text


def _too_slow(timeout_s: float | None) -> GatewayRequestError:
    return GatewayRequestError(
        f"messages: rendering the chat template took longer than render_timeout_s={timeout_s}",
        param="messages",
    )


def _check_kwargs(extra: dict[str, Any] | None) -> None:
    """400 naming the first key of ``chat_template_kwargs`` that shadows a variable the
    template is given."""
    for key in extra or ():
        if key in RESERVED_NAMES:
            raise GatewayRequestError(
                f"chat_template_kwargs: {key!r} is reserved (the template's own variable: "
                "special tokens, messages, tools and the template's functions cannot be "
                "overridden)",
                param="chat_template_kwargs",
            )


_RENDERERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="render")
"""Chat templates render here, not in the loop's default executor: slow renders (each
stops itself at its deadline) never hold up tokenizing or detokenizing there."""


async def render_messages(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    *,
    max_messages: int,
    max_bytes: int,
    timeout_s: float,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    extra: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt of a request's ``messages`` (and ``tools``), within the limits: at most
    ``max_messages`` (checked first), ``max_bytes`` of prompt, ``timeout_s`` of
    rendering, which runs on a thread unless the conversation is short."""
    if len(messages) > max_messages:
        raise GatewayRequestError(
            f"messages: {len(messages)} messages; this server takes at most "
            f"max_messages={max_messages}",
            param="messages",
        )

    def render() -> str:
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            extra=extra,
            max_bytes=max_bytes,
            timeout_s=timeout_s,
            tools=tools,
        )

    if len(messages) <= INLINE_RENDER_MESSAGES:
        return render()
    try:
        # The thread stops itself at the deadline too (between two pieces of output).
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(_RENDERERS, render), timeout_s)
    except TimeoutError:
        raise _too_slow(timeout_s) from None


def _check_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """A message with string content: text parts joined by newlines; other parts (images,
    audio) refused."""
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise GatewayRequestError(
            f"messages[{index}].role: expected a non-empty string, got {role!r}",
            param="messages",
        )
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise GatewayRequestError(
            f"messages[{index}].content: expected a string or a list of parts",
            param="messages",
        )
    texts = []
    for part_index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise GatewayRequestError(
                f"messages[{index}].content[{part_index}]: only text parts are supported "
                f"(this server takes no multimodal input), got type {kind!r}",
                param="messages",
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def load_chat_template(
    model_dir: str | Path, override: str | Path | None = None
) -> ChatTemplate | None:
    """The checkpoint's chat template (or ``override``, a file); None if it has none."""
    model_dir = Path(model_dir)
    config: dict[str, Any] = {}
    config_path = model_dir / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    special = {
        name: text for name in _SPECIAL if (text := _token_text(config.get(name))) is not None
    }
    if override:
        return ChatTemplate(Path(override).read_text(encoding="utf-8"), special)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), special)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source, special)
    return None
