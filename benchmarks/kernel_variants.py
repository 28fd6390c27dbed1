"""How many variants of the paged-attention kernel a GPU would compile over many batch
mixes: Triton compiles one per distinct set of constexprs and specialised ints, each
costing 0.5-2 s the first time a step brings it (a stall in serving).

Needs no GPU: a module that makes Triton compile for a CUDA target on a CPU-only
machine and skip the launch (one recording each compiled kernel in ``COMPILED`` as
``(kernel name, grid, compiled kernel)``) is imported first, from ``--fakecuda DIR``.

    .venv/bin/python benchmarks/kernel_variants.py --fakecuda DIR [--mixes 200]
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fakecuda", required=True, help="directory holding fakecuda.py")
    parser.add_argument("--mixes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, args.fakecuda)
    fakecuda = importlib.import_module("fakecuda")  # before the kernels are imported
    import torch

    from gpu_worker.kernels.paged_attention import paged_attention_triton

    rng = random.Random(args.seed)
    block_size, kv_heads, head_dim, heads = 16, 8, 128, 32
    key_cache = torch.zeros(4096, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    for _ in range(args.mixes):
        num_seqs = rng.choice([1, 2, 3, 7, 16, 17, 33, 64, 100, 255])
        chunk = rng.choice([0, 0, 1, 8, 100, 512])
        q_lens = [1] * num_seqs
        if chunk:
            q_lens[0] = chunk
        contexts = [rng.randint(q, q + 500) for q in q_lens]
        width = max(rng.choice([1, 5, 16, 33, 128, 200]), *(-(-c // block_size) for c in contexts))
        starts = [0]
        for q_len in q_lens:
            starts.append(starts[-1] + q_len)
        paged_attention_triton(
            torch.zeros(starts[-1], heads, head_dim, dtype=torch.bfloat16),
            key_cache,
            value_cache,
            torch.zeros(num_seqs, width, dtype=torch.int32),
            torch.tensor(contexts, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            head_dim**-0.5,
        )
    variants = {id(k) for name, _, k in fakecuda.COMPILED if name == "_paged_attention_kernel"}
    print(
        f"{args.mixes} batch mixes (1-255 sequences, decodes with or without a prefill chunk "
        f"of up to 512, block tables 1-200 wide), bf16, head_dim {head_dim}, GQA "
        f"{heads // kv_heads}:1: {len(variants)} compiled variants of the attention kernel"
    )


if __name__ == "__main__":
    main()
