"""The ``json`` bench workload: every request asks for a JSON object of its own schema,
drawn from the seeded family of :mod:`expeditor.bench.schema_family` (objects with
required fields and ``additionalProperties: false``, nested objects, arrays with item
bounds, enums, bounded numbers, short strings).

A request's constraint ends it when its object is complete, so its output length is
the model's. The same requests without their constraints are a target option,
``constraints=off`` (``--target 'expeditor[constraints=off]'``): run after a
constrained target, each request then generates exactly as many tokens as it did
there (ignoring EOS), so the two rows differ only in the constraints' cost."""

from __future__ import annotations

import random
from collections.abc import Sequence

from expeditor.bench.schema_family import schemas
from expeditor.bench.workloads import (
    DEFAULT_VOCAB,
    BenchRequest,
    Workload,
    check_count,
    check_range,
    check_vocab,
    random_prompt,
)

__all__ = ["json_schemas"]


def json_schemas(
    num_requests: int,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (16, 128),
    max_output: int = 160,
    vocab: Sequence[int] = DEFAULT_VOCAB,
) -> Workload:
    """All at t=0; prompt length uniform in ``prompt_len`` (BOS included); each request
    constrained to the JSON schema the family draws for it, ``max_tokens`` =
    ``max_output`` (the budget; the object usually ends first)."""
    check_count(num_requests)
    low, high = check_range("prompt_len", prompt_len)
    if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1:
        raise ValueError(f"max_output must be an integer >= 1, got {max_output!r}")
    check_vocab(vocab)
    rng = random.Random(seed)
    family = schemas(seed=seed, count=num_requests)
    requests = [
        BenchRequest(
            f"json-{index}",
            random_prompt(rng, vocab, rng.randint(low, high)),
            max_output,
            0.0,
            ignore_eos=False,
            structured_outputs={"json": schema},
        )
        for index, schema in enumerate(family)
    ]
    return Workload(
        "json",
        requests,
        f"{num_requests} requests at t=0, each constrained to its own JSON schema from a "
        f"seeded family; prompt {low}-{high} tokens; up to {max_output} output tokens",
    )
