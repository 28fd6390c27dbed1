"""How many variants of the attention kernels a GPU would compile over many batch mixes:
Triton compiles one per distinct set of constexprs and specialised arguments, each
costing 0.5-2 s the first time a step brings it (a stall in serving).

Needs no GPU: a module that makes Triton compile for a CUDA target on a CPU-only
machine and skip the launch (one recording each compiled kernel in ``COMPILED`` as
``(kernel name, grid, compiled kernel)``) is imported first, from ``--fakecuda DIR``.

Each mix goes through the served path: a schedule planned from host arrays for an H200
(132 SMs), then ``paged_attention_triton`` with it, the query head-major as
transformers hands it over, and the block table, lengths and starts at 8-byte
boundaries of one staging buffer (as the worker's staging leaves them). Contexts reach
32k, so long decodes take the split-KV kernels.

    .venv/bin/python benchmarks/kernel_variants.py --fakecuda DIR [--mixes 200]
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
from collections import Counter

ATTENTION_KERNELS = (
    "_paged_attention_kernel",
    "_split_kv_partial_kernel",
    "_split_kv_reduce_kernel",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fakecuda", required=True, help="directory holding fakecuda.py")
    parser.add_argument("--mixes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    parser.add_argument("--softcap", type=float, default=0.0, help="logit softcap (0: none)")
    args = parser.parse_args()
    sys.path.insert(0, args.fakecuda)
    fakecuda = importlib.import_module("fakecuda")  # before the kernels are imported
    import numpy as np
    import torch

    from gpu_worker.kernels.attention_schedule import plan_attention
    from gpu_worker.kernels.paged_attention import paged_attention_triton

    rng = random.Random(args.seed)
    block_size, kv_heads, head_dim, heads, num_sms = 16, 8, 128, 32, 132
    dtype = torch.bfloat16
    kv = torch.zeros(4096, 2, 2, block_size, kv_heads, head_dim, dtype=dtype)
    key_cache, value_cache = kv[:, 1, 0], kv[:, 1, 1]
    kinds: Counter[str] = Counter()
    for _ in range(args.mixes):
        num_seqs = rng.choice([1, 2, 3, 7, 16, 17, 33, 64, 100, 255])
        chunk = rng.choice([0, 0, 1, 8, 100, 512])
        q_lens = [1] * num_seqs
        if chunk:
            q_lens[0] = chunk
        longest = rng.choice([500, 500, 4096, 32768])
        contexts = [q + rng.randint(0, longest) for q in q_lens]
        width = max(rng.choice([1, 5, 16, 33, 128, 200]), *(-(-c // block_size) for c in contexts))
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        lens = np.array(contexts, dtype=np.int32)
        # One staging buffer, each array at an 8-byte boundary (so, at random, 16).
        staged, at = torch.zeros(num_seqs * (width + 2) + 16, dtype=torch.int32), 0
        views = []
        for array in (np.zeros(num_seqs * width, dtype=np.int32), lens, starts):
            at += rng.choice([0, 2]) + (-at % 2)
            views.append(staged[at : at + len(array)].copy_(torch.from_numpy(array)))
            at += len(array)
        schedule = plan_attention(
            starts,
            lens,
            num_kv_heads=kv_heads,
            queries_per_kv=heads // kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            num_sms=num_sms,
            device="cpu",
        )
        kinds.update(schedule.kinds)
        query = torch.zeros(1, heads, int(starts[-1]), head_dim, dtype=dtype)[0].transpose(0, 1)
        paged_attention_triton(
            query,
            key_cache,
            value_cache,
            views[0].view(num_seqs, width),
            views[1],
            views[2],
            head_dim**-0.5,
            window=args.window or None,
            softcap=args.softcap or None,
            schedule=schedule,
        )
    per_kernel = {
        name: len({id(k) for n, _, k in fakecuda.COMPILED if n == name})
        for name in ATTENTION_KERNELS
    }
    flags = f"window {args.window or 'none'}, softcap {args.softcap or 'none'}"
    print(
        f"{args.mixes} batch mixes (1-255 sequences, decodes with or without a prefill chunk "
        f"of up to 512, contexts up to 32k, block tables 1-2048 wide), bf16, head_dim "
        f"{head_dim}, GQA {heads // kv_heads}:1, {flags}, {num_sms} SMs: "
        f"{sum(per_kernel.values())} compiled variants of the attention kernels "
        + ", ".join(f"({n}: {c})" for n, c in per_kernel.items())
        + "; launches by kind: "
        + ", ".join(f"{k} {c}" for k, c in sorted(kinds.items()))
    )


if __name__ == "__main__":
    main()
