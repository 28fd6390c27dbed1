"""The ``multi-turn`` bench workload: chat conversations that re-send their history.

Each conversation opens with a system prompt all of them share, then takes turns: a
turn's prompt is the previous turn's prompt, an assistant answer and a new user
message, so everything but the last two is a prefix the server has seen. Turns of one
conversation are ``think_s`` apart, conversations start ``stagger_s`` apart, so the
other conversations' turns run in between and push an idle conversation's history
out of a small device pool: the case for the prefix cache's host tier
(``prefix_cache_cpu_blocks``).

Open loop: the assistant answers in the history are the workload's own tokens, not the
model's outputs (the requests are made before the run), so what a turn can reuse is
the previous turn's prompt; the answer it re-sends is new to the cache as is its user
message. The ``config`` hint sizes the device pool at ``pool_fraction`` of the
working set (every conversation's last prompt and answer).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from expeditor.bench.workloads import (
    BOS_TOKEN_ID,
    DEFAULT_VOCAB,
    BenchRequest,
    Workload,
    check_count,
    check_pool_hint,
    check_range,
    check_vocab,
    random_prompt,
)

__all__ = ["multi_turn"]


def multi_turn(
    num_requests: int,
    *,
    seed: int = 0,
    turns: int = 8,
    system_len: int = 64,
    user_len: tuple[int, int] = (16, 48),
    answer_len: int = 48,
    think_s: float = 10.0,
    stagger_s: float = 1.5,
    pool_fraction: float = 1 / 3,
    block_size: int = 16,
    vocab: Sequence[int] = DEFAULT_VOCAB,
) -> Workload:
    """``num_requests // turns`` conversations (at least one) of ``turns`` turns:

    - turn 0 of conversation ``c`` arrives at ``c * stagger_s``, turn ``t`` at
      ``t * think_s`` after it;
    - turn 0's prompt: BOS, a shared ``system_len``-token system prompt, a user message
      of ``user_len`` tokens (uniform); turn ``t``'s: turn ``t - 1``'s prompt, an
      ``answer_len``-token answer, a new user message;
    - ``max_tokens``: ``answer_len`` (ignore_eos);
    - ``config`` hint: ``block_size``, ``enable_prefix_caching`` and ``num_gpu_blocks``
      = max(the largest request's blocks + 1, ``pool_fraction`` x the working set).
    """
    check_count(num_requests)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
    for name, value in (("system_len", system_len), ("answer_len", answer_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    u_low, u_high = check_range("user_len", user_len)
    for name, seconds in (("think_s", think_s), ("stagger_s", stagger_s)):
        if not (isinstance(seconds, int | float) and seconds >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {seconds!r}")
    check_pool_hint(pool_fraction, block_size)
    check_vocab(vocab)
    rng = random.Random(seed)
    system = random_prompt(rng, vocab, system_len + 1)[1:]  # (random_prompt starts with BOS)
    num_conversations = max(1, num_requests // turns)
    requests: list[BenchRequest] = []
    working_set = 0
    largest = 0
    for conversation in range(num_conversations):
        history = [BOS_TOKEN_ID, *system]
        for turn in range(turns):
            if turn:
                history += random_prompt(rng, vocab, answer_len + 1)[1:]
            history += random_prompt(rng, vocab, rng.randint(u_low, u_high) + 1)[1:]
            arrival = conversation * stagger_s + turn * think_s
            requests.append(
                BenchRequest(f"chat-{conversation}-{turn}", list(history), answer_len, arrival)
            )
            largest = max(largest, -(-(len(history) + answer_len) // block_size))
        working_set += -(-(len(history) + answer_len) // block_size)
    requests.sort(key=lambda r: r.arrival_s)
    num_gpu_blocks = max(largest + 1, int(pool_fraction * working_set))
    return Workload(
        "multi-turn",
        requests,
        f"{num_conversations} conversations of {turns} turns, {think_s:g} s apart, each "
        f"re-sending its history (a shared {system_len}-token system prompt, {u_low}-{u_high}"
        f"-token user messages, {answer_len}-token answers); KV pool hint of "
        f"{num_gpu_blocks} blocks of {block_size} tokens against a working set of "
        f"{working_set} ({pool_fraction:.2g} of it): the prefix cache's host tier",
        config={
            "num_gpu_blocks": num_gpu_blocks,
            "block_size": block_size,
            "enable_prefix_caching": True,
        },
    )
