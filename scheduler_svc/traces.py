"""Synthetic, seeded request traces for the simulator and the scheduler benchmark."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from scheduler_svc.simulator import TraceRequest


def generate_trace(
    num_requests: int,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (16, 512),
    arrival_rate: float | None = None,
    priorities: tuple[int, ...] = (0,),
    n_choices: tuple[int, ...] = (1,),
    eos_fraction: float = 0.0,
    abort_fraction: float = 0.0,
    shared_prefixes: int = 0,
    shared_prefix_len: int = 256,
    id_prefix: str = "req-",
) -> list[TraceRequest]:
    """Requests with uniform prompt and output lengths.

    ``arrival_rate`` is requests per step (Poisson arrivals); None puts every request at
    step 0. ``eos_fraction`` of requests stop early at a uniform point of their output,
    ``abort_fraction`` are aborted by the client some steps after arrival.
    ``shared_prefixes`` > 0 gives every prompt one of that many common prefixes of
    ``shared_prefix_len`` tokens (the rest of the prompt stays private).
    """
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    for name, (low, high) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {low}..{high}")
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 32000) for _ in range(shared_prefix_len)] for _ in range(shared_prefixes)
    ]
    step = 0.0
    trace = []
    for index in range(num_requests):
        if arrival_rate:
            step += rng.expovariate(arrival_rate)
        arrival = int(step)
        length = rng.randint(*prompt_len)
        max_tokens = rng.randint(*output_len)
        prompt_ids = None
        if prefixes:
            prefix = rng.choice(prefixes)
            suffix_len = max(1, length - len(prefix))
            prompt_ids = prefix + [rng.randrange(3, 32000) for _ in range(suffix_len)]
        trace.append(
            TraceRequest(
                id=f"{id_prefix}{index}",
                arrival_step=arrival,
                prompt_len=None if prompt_ids else length,
                prompt_token_ids=prompt_ids,
                max_tokens=max_tokens,
                priority=rng.choice(priorities),
                n=rng.choice(n_choices),
                eos_at=rng.randint(1, max_tokens) if rng.random() < eos_fraction else None,
                abort_step=(
                    arrival + rng.randint(1, max_tokens) if rng.random() < abort_fraction else None
                ),
            )
        )
    return trace


def write_trace(trace: list[TraceRequest], path: Path) -> None:
    encoder = msgspec.json.Encoder()
    with path.open("wb") as handle:
        for request in trace:
            raw = msgspec.to_builtins(request)
            handle.write(encoder.encode({k: v for k, v in raw.items() if v is not None}))
            handle.write(b"\n")
