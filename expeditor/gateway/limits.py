"""What one HTTP request may cost the gateway, checked before any work is done: the
size of a completion batch, its choices (``n`` x prompts) and the size of the response
it asks for (echo amplification, many long samples with logprobs). Each refusal is a
400 naming the limit and its ``[gateway]`` setting.

The response is measured in tokens, the unit known up front: every choice carries its
echoed prompt (token id prompts: their length; text prompts: one token per
:data:`ECHO_BYTES_PER_TOKEN` bytes of UTF-8, a little above a typical tokenizer's
average) and up to ``max_tokens`` generated tokens, each counted ``2 + logprobs`` times
when logprobs are asked for (the token, its logprob and ``logprobs`` alternatives; an
echoed prompt's tokens too, which then come with theirs); vLLM's ``prompt_logprobs``
count ``2 + prompt_logprobs`` per prompt token.
"""

from __future__ import annotations

from collections.abc import Sequence

from expeditor.gateway.protocol import GatewayRequestError
from shared.gateway_config import GatewayConfig

__all__ = [
    "ECHO_BYTES_PER_TOKEN",
    "check_batch",
    "check_response_size",
    "echo_tokens",
    "prompt_logprob_tokens",
    "response_tokens",
]

ECHO_BYTES_PER_TOKEN = 4
"""Bytes of an echoed text prompt counted as one token of the response."""


def check_batch(prompts: int, n: int, config: GatewayConfig) -> None:
    """400 when a completion batch has more prompts, or more choices, than allowed."""
    if prompts > config.max_batch_prompts:
        raise GatewayRequestError(
            f"prompt: a batch of {prompts} prompts; this server takes at most "
            f"max_batch_prompts={config.max_batch_prompts}",
            param="prompt",
        )
    if prompts * n > config.max_batch_choices:
        raise GatewayRequestError(
            f"n: {n} samples of {prompts} prompt(s) make {prompts * n} choices; this "
            f"server answers at most max_batch_choices={config.max_batch_choices}",
            param="n",
        )


def echo_tokens(prompt: str | Sequence[int]) -> int:
    """What echoing ``prompt`` adds to each of its choices, in tokens."""
    if isinstance(prompt, str):
        size = len(prompt) if prompt.isascii() else len(prompt.encode("utf-8", "replace"))
        return -(-size // ECHO_BYTES_PER_TOKEN)
    return len(prompt)


def response_tokens(
    n: int, echoed: Sequence[int], max_tokens: int, logprobs: int | None, listed: int = 0
) -> int:
    """The tokens of a response: ``n`` choices per prompt, each its echoed prompt
    (``echoed``: per prompt, 0 without echo) and ``max_tokens`` generated tokens, with
    their ``logprobs``; and ``listed``, the prompt logprobs it lists
    (:func:`prompt_logprob_tokens`)."""
    per_token = 1 if logprobs is None else 2 + logprobs
    return n * (sum(echoed) + len(echoed) * max_tokens) * per_token + listed


def prompt_logprob_tokens(sizes: Sequence[int], prompt_logprobs: int | None) -> int:
    """What listing vLLM's ``prompt_logprobs`` of prompts of ``sizes`` tokens adds to a
    response, once: ``2 + prompt_logprobs`` per prompt token."""
    return 0 if prompt_logprobs is None else sum(sizes) * (2 + prompt_logprobs)


def check_response_size(estimate: int, config: GatewayConfig, param: str) -> None:
    """400 naming ``param`` when ``estimate`` is beyond max_response_tokens."""
    limit = config.max_response_tokens
    if estimate > limit:
        raise GatewayRequestError(
            f"{param}: this request asks for a response of up to {estimate} tokens "
            "(choices x (echoed prompt + max_tokens), logprobs included); this server "
            f"answers at most max_response_tokens={limit}: lower n, max_tokens or "
            "logprobs, or send fewer prompts",
            param=param,
        )
