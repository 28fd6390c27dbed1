"""What the sampling controls cost a decode step: the worker's sampler over one batch
of logits with no controls, with every row penalised (repetition, presence and
frequency over its prompt and output so far), and with every control at once (the
penalties, a logit bias of 20 tokens, about 1,000 allowed tokens, bad words, min-p),
interleaved, medians.

Greedy rows (the served default) and random ones (temperature 0.8, top-p 0.95); the
logits are float32 ``[batch, vocab]`` as the LM head gives them (SmolLM2's vocabulary
by default), each row's history ``--context`` tokens of prompt and a quarter of that
of output.

    .venv/bin/python benchmarks/sampling_cost.py [--batch 64] [--vocab 49152] \
        [--context 300] [--rounds 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from gpu_worker.logits_shaping import History
from gpu_worker.sampler import Sampler, sample_key
from shared.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    logits = torch.randn(args.batch, args.vocab) * 4
    histories = [
        History(
            rng.integers(0, args.vocab, args.context),
            rng.integers(0, args.vocab, args.context // 4),
        )
        for _ in range(args.batch)
    ]
    penalties = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    everything = {
        **penalties, "logit_bias": {int(t): 2.0 for t in rng.integers(0, args.vocab, 20)},
        "allowed_token_ids": tuple(range(0, args.vocab, 49)), "min_p": 0.05,
    }  # fmt: skip
    bans = [np.array([7, 9], dtype=np.int64)] * args.batch  # bad words' last tokens
    sampler = Sampler()
    results: dict[str, dict[str, float]] = {}
    for mode, base in (("greedy", {"temperature": 0.0}), ("random", {"temperature": 0.8,
                                                                      "top_p": 0.95})):  # fmt: skip
        kinds = {
            "none": (SamplingParams(**base), [()] * args.batch),
            "penalties": (SamplingParams(**base, **penalties), [()] * args.batch),
            "everything": (SamplingParams(**base, **everything), bans),
        }
        times: dict[str, list[float]] = {name: [] for name in kinds}
        keys = [sample_key(1, i) for i in range(args.batch)]
        for round_ in range(args.rounds + 1):
            order = list(kinds) if round_ % 2 else list(reversed(kinds))
            for name in order:
                params, masked = kinds[name]
                start = time.perf_counter()
                sampler.sample(logits, [params] * args.batch, keys, masked, histories)
                if round_:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        results[mode] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    if args.json:
        print(json.dumps({"batch": args.batch, "vocab": args.vocab, "ms": results}))
        return
    print(f"batch {args.batch}, vocab {args.vocab}, history {args.context}+{args.context // 4}:")
    for mode, ms in results.items():
        print(f"  {mode:6s} " + "  ".join(f"{name} {value:6.2f} ms" for name, value in ms.items()))


if __name__ == "__main__":
    main()
