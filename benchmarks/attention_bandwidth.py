"""Paged-attention read bandwidth against the device's copy bandwidth (CUDA only).

A decode batch (one query token per sequence) over long paged contexts is bound by
reading the K/V cache; this reports the bytes of K/V read per second by the Triton
kernel, and, in the same run, the read bandwidth of a plain device copy of that many
bytes. The step's attention schedule is planned once, outside the timed loop, as a
served step plans it once for every layer (``--no-split`` keeps long decodes off the
split-KV path, to compare).

    python benchmarks/attention_bandwidth.py [--seqs 64] [--context 4096] [--no-split]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from gpu_worker.kernels import paged_attention_triton, plan_attention


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-split", action="store_true", help="no split-KV decodes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_bandwidth needs CUDA")
    device = torch.device("cuda")
    dtype = torch.bfloat16
    bs = args.block_size
    blocks_per_seq = -(-args.context // bs)
    num_blocks = args.seqs * blocks_per_seq
    kv = torch.randn(num_blocks, 2, bs, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(args.seqs, blocks_per_seq)
    seq_lens = torch.full((args.seqs,), args.context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(args.seqs + 1, dtype=torch.int32, device=device)
    query = torch.randn(args.seqs, args.heads, args.head_dim, dtype=dtype, device=device)
    scale = args.head_dim**-0.5
    schedule = plan_attention(
        np.arange(args.seqs + 1),
        np.full(args.seqs, args.context),
        num_kv_heads=args.kv_heads,
        queries_per_kv=args.heads // args.kv_heads,
        head_dim=args.head_dim,
        block_size=bs,
        num_sms=0 if args.no_split else None,
        device=device,
    )
    seconds = timed(
        lambda: paged_attention_triton(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            schedule=schedule,
        )
    )
    kv_bytes = args.seqs * args.context * args.kv_heads * args.head_dim * 2 * kv.element_size()
    flat = kv.view(-1)
    target = torch.empty_like(flat)
    copy_seconds = timed(lambda: target.copy_(flat))
    copy_read_gbps = flat.numel() * flat.element_size() / copy_seconds / 1e9
    result = {
        "seqs": args.seqs,
        "context": args.context,
        "split_seqs": len(schedule.split_seqs),
        "kv_bytes": kv_bytes,
        "attention_ms": seconds * 1e3,
        "attention_read_gbps": kv_bytes / seconds / 1e9,
        "copy_read_gbps": copy_read_gbps,
        "ratio": kv_bytes / seconds / 1e9 / copy_read_gbps,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
