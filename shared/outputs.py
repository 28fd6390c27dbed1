"""What a finished request returns, in the engine and (later) over the wire."""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.StrEnum):
    """Why a sample ended; on the wire as its value."""

    STOP = "stop"
    """EOS, a stop token or a stop string."""
    LENGTH = "length"
    """``max_tokens`` or the model's context length."""
    ABORT = "abort"
    """Aborted (by its client, or the client went away)."""


class PromptLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """Logprobs of prompt positions ``first``, ``first + 1``, ... (the first prompt
    token has none: nothing precedes it), from the raw logits of the position before
    each (float32 log-softmax, no penalties, bias or temperature)."""

    first: int = 1
    """The prompt position of ``entries[0]`` (1 in a :class:`Completion`; a worker's
    step covers the positions of its prefill chunk)."""
    entries: list[dict[int, float]] = []
    """Per position: its prompt token and the top ``prompt_logprobs`` tokens -> logprob."""
    ranks: list[int] = []
    """Per position: its prompt token's rank among the vocabulary (1 = most likely)."""


class CompletionSample(msgspec.Struct, frozen=True, kw_only=True):
    """One of the n samples of a request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[dict[int, float]] | None = None
    """Per output token, when asked for: the sampled token and the top ones -> logprob."""
    stop_reason: str | int | None = None
    """What stopped it: the stop string, or the stop token id (``stop_token_ids``; None
    for EOS and for the other finish reasons)."""


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    samples: list[CompletionSample]
    prompt_logprobs: PromptLogprobs | None = None
    """With ``SamplingParams.prompt_logprobs``: those of every prompt position from 1."""

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def finish_reason(self) -> FinishReason:
        return self.samples[0].finish_reason
