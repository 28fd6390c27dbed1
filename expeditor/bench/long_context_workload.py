"""The ``long-context`` bench workload: contexts several times a sliding window.

Every request arrives at once with a prompt that, with its answer, reaches
``context_multiple`` times ``window`` tokens. For a model whose every layer is windowed
(tiny mistral; Mistral-7B-v0.1 at real sizes), each sequence then only ever reads its
last ``window`` keys: the scheduler's ``free_out_of_window_blocks`` gives back the rest,
so the same device pool holds several times the sequences. The ``config`` hint sizes
the pool at ``pool_fraction`` of the working set (every request's whole context), which
whole contexts overflow and windows do not. A model that mixes windowed and full
layers (tiny gemma2, gemma3, qwen2) lays its cache out in layer groups and gives back
only its windowed groups' blocks; one without a window (the real SmolLM2) holds whole
contexts either way.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from expeditor.bench.workloads import (
    DEFAULT_VOCAB,
    BenchRequest,
    Workload,
    check_count,
    check_pool_hint,
    check_range,
    check_vocab,
    random_prompt,
)

__all__ = ["long_context"]

TINY_WINDOW = 22
"""The tiny checkpoints' sliding window (``gpu_worker.tiny_model.SLIDING_WINDOW``)."""


def long_context(
    num_requests: int,
    *,
    seed: int = 0,
    window: int = TINY_WINDOW,
    context_multiple: float = 8.0,
    output_len: tuple[int, int] = (16, 32),
    pool_fraction: float = 0.25,
    block_size: int = 16,
    vocab: Sequence[int] = DEFAULT_VOCAB,
) -> Workload:
    """``num_requests`` requests at t=0:

    - ``max_tokens``: uniform integer in ``[output_len[0], output_len[1]]`` (ignore_eos);
    - prompt (BOS included): ``round(context_multiple * window)`` tokens less that, so
      prompt and answer end at the same context length;
    - ``config`` hint: ``block_size`` and ``num_gpu_blocks`` = max(one context's blocks
      + 1, ``pool_fraction`` x the working set of whole contexts).
    """
    check_count(num_requests)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    if not (isinstance(context_multiple, int | float) and context_multiple >= 1):
        raise ValueError(f"context_multiple must be a number >= 1, got {context_multiple!r}")
    o_low, o_high = check_range("output_len", output_len)
    context = round(context_multiple * window)
    if context <= o_high + 1:
        raise ValueError(
            f"a context of {context} tokens ({context_multiple:g} x window {window}) leaves "
            f"no prompt beside up to {o_high} output tokens"
        )
    check_pool_hint(pool_fraction, block_size)
    check_vocab(vocab)
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        output = rng.randint(o_low, o_high)
        prompt = random_prompt(rng, vocab, context - output)
        requests.append(BenchRequest(f"long-{index}", prompt, output, 0.0))
    blocks = -(-context // block_size)
    num_gpu_blocks = max(blocks + 1, int(pool_fraction * blocks * num_requests))
    return Workload(
        "long-context",
        requests,
        f"{num_requests} requests all arriving at t=0, each reaching a {context}-token "
        f"context ({context_multiple:g} x a {window}-token window; output {o_low}-{o_high} "
        f"tokens); KV pool hint of {num_gpu_blocks} blocks of {block_size} tokens against "
        f"{blocks * num_requests} for every whole context ({pool_fraction:g} of it): "
        "sliding-window models fit more at once",
        config={"num_gpu_blocks": num_gpu_blocks, "block_size": block_size},
    )
