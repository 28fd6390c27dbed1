"""What may be submitted: the checks a request passes before it is queued.

Pure functions of the request and the configuration (no scheduler state), so the core
stays one concept: :meth:`Scheduler.add_request` adds what depends on its state
(duplicate ids, a full waiting queue). Every refusal is a
:class:`~scheduler_svc.core.request.RejectedError` whose code says whether retrying can help.
"""

from __future__ import annotations

from ipc.schema import ErrorCode
from scheduler_svc.core.request import RejectedError
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams


def check_request(
    config: SchedulerConfig,
    request_id: object,
    prompt: object,
    params: object,
    priority: object,
    client: object,
    *,
    vocab_size: int | None,
    capacity_blocks: int,
) -> int:
    """Refuse a request that is malformed or can never fit; returns the most output
    tokens it may produce (``max_tokens``, else what ``max_model_len`` leaves)."""
    bad = ErrorCode.BAD_REQUEST
    if not isinstance(request_id, str) or not request_id:
        raise RejectedError(bad, "request_id must be a non-empty string")
    if not isinstance(params, SamplingParams):
        raise RejectedError(bad, "params must be SamplingParams")
    if type(priority) is not int:
        raise RejectedError(bad, f"priority must be an integer, got {priority!r}")
    if not isinstance(client, str):
        raise RejectedError(bad, f"client must be a string, got {client!r}")
    if not isinstance(prompt, list) or not prompt:
        raise RejectedError(bad, "prompt_token_ids must be a non-empty list", "prompt_token_ids")
    if not all(type(t) is int and t >= 0 for t in prompt):
        raise RejectedError(
            bad, "prompt_token_ids must hold non-negative integers", "prompt_token_ids"
        )
    if vocab_size is not None and max(prompt) >= vocab_size:
        position, token = next((i, t) for i, t in enumerate(prompt) if t >= vocab_size)
        raise RejectedError(
            bad,
            f"prompt_token_ids: token id {token} (position {position}) is outside the "
            f"model's vocabulary [0, {vocab_size})",
            "prompt_token_ids",
        )
    if vocab_size is not None:
        _check_ids_in_vocabulary(params, vocab_size)
    if params.n > config.max_num_seqs:
        raise RejectedError(bad, f"n={params.n} exceeds max_num_seqs={config.max_num_seqs}", "n")
    asked = params.num_speculative_tokens
    if asked and asked > config.num_speculative_tokens:
        raise RejectedError(
            bad,
            f"num_speculative_tokens: {asked} exceeds the server's num_speculative_tokens "
            f"({config.num_speculative_tokens}"
            + ("; speculative decoding is off" if not config.num_speculative_tokens else "")
            + ")",
            "num_speculative_tokens",
        )
    max_len = config.max_model_len
    if len(prompt) >= max_len:
        raise RejectedError(
            ErrorCode.REJECTED,
            f"prompt has {len(prompt)} tokens; max_model_len={max_len} leaves no room for output",
        )
    max_output = params.max_tokens or max_len - len(prompt)
    total = len(prompt) + max_output
    if total > max_len:
        raise RejectedError(
            ErrorCode.REJECTED,
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_output}) = {total} "
            f"exceeds max_model_len={max_len}",
        )
    blocks = -(-total // config.block_size)
    if blocks > capacity_blocks:
        raise RejectedError(
            ErrorCode.REJECTED,
            f"{total} tokens need {blocks} KV blocks; the cache admits at most {capacity_blocks}",
        )
    return max_output


def _check_ids_in_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """The token ids the sampling parameters name, all in ``[0, vocab_size)``."""
    named = {
        "logit_bias": [token for token, _ in params.logit_bias],  # type: ignore[union-attr]
        "allowed_token_ids": params.allowed_token_ids,
        "bad_words": [t for word in params.bad_words_token_ids for t in word],
    }
    for field, ids in named.items():
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise RejectedError(
                ErrorCode.BAD_REQUEST,
                f"{field}: token id {outside[0]} is outside the model's vocabulary "
                f"[0, {vocab_size})",
                field,
            )
