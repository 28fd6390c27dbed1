"""OpenAI response bodies: completions and chat completions, whole or as server-sent
event chunks (``data: {json}\\n\\n``, ending ``data: [DONE]\\n\\n``), usage and logprobs.

Bodies are plain dicts encoded with msgspec's JSON encoder (fast, and the shapes stay
readable next to the OpenAI reference).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from expeditor.gateway.protocol import ChatCompletionRequest, CompletionRequest, GatewayRequestError
from ipc.errors import (
    UNREACHABLE,
    OverloadedError,
    QuarantinedError,
    ServerError,
    ShuttingDownError,
    WorkerLostError,
)
from ipc.schema import Usage
from shared.outputs import PromptLogprobs

log = logging.getLogger("expeditor.gateway")

__all__ = [
    "DONE",
    "add_usage",
    "chat_logprobs",
    "completion_logprobs",
    "echo_logprobs",
    "error_body",
    "error_of",
    "join_logprobs",
    "json_bytes",
    "prompt_logprobs_body",
    "sse",
    "usage_body",
]

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode

TokenText = Callable[[int], str]
"""A token id's text (decoded alone)."""


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body``."""
    return b"data: " + _encode(body) + b"\n\n"


def json_bytes(body: dict[str, Any]) -> bytes:
    return _encode(body)


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_FIELDS = {*CompletionRequest.__struct_fields__, *ChatCompletionRequest.__struct_fields__}
_BODY_NAMES = {"bad_words_token_ids": "bad_words", "prompt_token_ids": "prompt"}


def _param(field: str | None) -> str | None:
    """The body field the scheduler's refusal names (its ``ErrorReply.field``), as the
    body calls it; None when it names none of the body's."""
    name = _BODY_NAMES.get(field, field) if field else None
    return name if name in _FIELDS else None


def error_of(exc: Exception) -> dict[str, Any]:
    """The error object for anything a request raised: the gateway's own refusals, the
    scheduler's (by its error code), and a scheduler that does not answer; anything else
    is a gateway bug (logged, 500). The HTTP status is its ``code``. One mapping for the
    error responses and for the error events that end a stream."""
    if isinstance(exc, GatewayRequestError):
        return error_body(exc.message, exc.kind, exc.status, exc.param)
    if isinstance(exc, OverloadedError):
        return error_body(exc.message, "overloaded", 429)
    if isinstance(exc, ShuttingDownError | WorkerLostError):
        return error_body(exc.message, "ServiceUnavailableError", 503)
    if isinstance(exc, QuarantinedError):
        return error_body(exc.message, "InternalServerError", 500)
    if isinstance(exc, ServerError):
        if exc.code == "internal":
            return error_body(exc.message, "InternalServerError", 500)
        return error_body(exc.message, "BadRequestError", 400, _param(exc.field))
    if isinstance(exc, UNREACHABLE):
        message = f"the scheduler does not answer: {exc}"
        return error_body(message, "ServiceUnavailableError", 503)
    log.error("a request failed", exc_info=exc)
    return error_body("the gateway failed to handle this request", "InternalServerError", 500)


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def add_usage(usages: list[Usage]) -> dict[str, Any]:
    """The usage of a response made of several scheduler requests (a prompt batch)."""
    return usage_body(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
    )


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, float]],
    text_of: TokenText,
    offset: int,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``token_ids``; ``offset`` is the
    character position of the first token in the choice's text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for token, entry in zip(token_ids, entries, strict=False):
        text = text_of(token)
        tokens.append(text)
        token_logprobs.append(entry.get(token))
        top.append({text_of(t): lp for t, lp in _ranked(entry)})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt_ids: list[int], plp: PromptLogprobs, text_of: TokenText, top_n: int
) -> dict[str, Any]:
    """The legacy ``logprobs`` object of an echoed prompt: its first token has none
    (``null``), the others their logprob and, with it, the ``top_n`` most likely tokens
    of their position; text offsets from 0."""
    texts = [text_of(t) for t in prompt_ids]
    token_logprobs: list[float | None] = [None]
    top: list[dict[str, float] | None] = [None]
    for token, entry in zip(prompt_ids[1:], plp.entries, strict=False):
        token_logprobs.append(entry.get(token))
        ranked = _ranked(entry)
        top.append({text_of(t): lp for i, (t, lp) in enumerate(ranked) if i < top_n or t == token})
    offsets = [0]
    for text in texts[:-1]:
        offsets.append(offsets[-1] + len(text))
    return {
        "tokens": texts,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy ``logprobs`` objects, one after the other (the echoed prompt's, then
    the sample's)."""
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in head}


def prompt_logprobs_body(
    prompt_ids: list[int], plp: PromptLogprobs, text_of: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position, ``null`` for the first, then
    token id -> ``{logprob, rank, decoded_token}`` for its token and the top ones."""
    body: list[dict[str, dict[str, Any]] | None] = [None]
    for token, entry, rank in zip(prompt_ids[1:], plp.entries, plp.ranks, strict=False):
        position: dict[str, dict[str, Any]] = {}
        for top_rank, (t, lp) in enumerate(_ranked(entry), start=1):
            position[str(t)] = {
                "logprob": lp,
                "rank": rank if t == token else top_rank,
                "decoded_token": text_of(t),
            }
        body.append(position)
    return body


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], text_of: TokenText, top_n: int
) -> dict[str, Any]:
    """The chat ``logprobs`` object: per token its text, logprob, UTF-8 bytes and the
    ``top_n`` most likely tokens."""
    content = []
    for token, entry in zip(token_ids, entries, strict=False):
        text = text_of(token)
        content.append(
            {
                "token": text,
                "logprob": entry.get(token, float("-inf")),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": text_of(t),
                        "logprob": lp,
                        "bytes": list(text_of(t).encode("utf-8")),
                    }
                    for t, lp in _ranked(entry)[:top_n]
                ],
            }
        )
    return {"content": content}


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])
