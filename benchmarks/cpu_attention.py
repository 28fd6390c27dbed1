"""The native CPU attention kernel's decode step, and the K/V bytes it reads per second
against a plain read of memory (``torch.sum`` over as many bytes, same threads).

One step of decodes (one query row per sequence) through every layer, the cache laid
out as the worker's (``[blocks, layers, 2, block_size, kv_heads, head_dim]``, block ids
shuffled), contexts uniform in [context/2, 3*context/2]. ``--matmul`` runs a layer's
worth of bf16 weight reads between two layers, untimed, as a served step does (the
weights then evict the caches the kernel would find warm). SmolLM2-135M's shapes by
default (30 layers, 9 query / 3 KV heads of 64, block 16).

    .venv/bin/python benchmarks/cpu_attention.py [--seqs 64] [--context 140] \
        [--dtype bfloat16] [--matmul] [--rounds 7] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from gpu_worker.attention.native_backend import NativeBackend, load
from gpu_worker.kernels.attention_args import layer_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=140)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--matmul", action="store_true", help="weight reads between layers")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads, the kernel's too (0: torch's)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    bs, layers = args.block_size, args.layers
    layout = argparse.Namespace(
        num_layers=layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=bs, dtype=dtype, kv_dtype=None,
    )  # fmt: skip
    kernels, why = load(torch.device("cpu"), layout, args.heads)
    if kernels is None:
        raise SystemExit(f"no native kernel: {why}")
    rng = np.random.default_rng(0)
    lens = rng.integers(args.context // 2, args.context * 3 // 2 + 1, args.seqs).astype(np.int32)
    width = int(-(-lens.max() // bs))
    num_blocks = args.seqs * width
    tables = rng.permutation(num_blocks).reshape(args.seqs, width).astype(np.int32)
    shape = (num_blocks, layers, 2, bs, args.kv_heads, args.head_dim)
    kv = torch.randn(shape, dtype=torch.float32).to(dtype)
    backend = NativeBackend(layout, args.heads, torch.device("cpu"), kernels)
    rows = np.arange(args.seqs)
    arrays = {
        "block_tables": tables,
        "seq_lens": lens,
        "query_start_loc": np.arange(args.seqs + 1, dtype=np.int32),
        "slot_mapping": tables[rows, (lens - 1) // bs].astype(np.int64) * bs + (lens - 1) % bs,
    }
    step = backend.plan(arrays, num_blocks)
    q = torch.randn(args.seqs, args.heads, args.head_dim).to(dtype)
    out = torch.empty_like(q)
    params = layer_params(args.head_dim**-0.5, None, None)
    hidden = args.heads * args.head_dim  # a layer's weights: about 7 hidden x hidden
    weights = [torch.randn(7 * hidden, hidden).to(dtype) for _ in range(layers)]
    x = torch.randn(args.seqs, hidden).to(dtype)

    def step_time() -> float:
        spent = 0.0
        for layer in range(layers):
            if args.matmul:
                torch.nn.functional.linear(x, weights[layer])
            start = time.perf_counter()
            kernels.attend(q, None, (kv[:, layer, 0], kv[:, layer, 1]), step, out, params)
            spent += time.perf_counter() - start
        return spent

    step_time()  # warm up
    times = [step_time() for _ in range(args.rounds)]
    kv_bytes = int(lens.sum()) * layers * 2 * args.kv_heads * args.head_dim * kv.element_size()
    read = kv.view(-1)[: kv_bytes // kv.element_size()]
    read_s = statistics.median(timed_sum(read) for _ in range(args.rounds))
    result = {
        "seqs": args.seqs, "context": args.context, "dtype": args.dtype,
        "threads": kernels.threads(), "features": list(kernels.features),
        "matmul": args.matmul, "kernel_ms": 1e3 * statistics.median(times),
        "kv_mb": kv_bytes / 1e6, "memory_read_gb_s": kv_bytes / read_s / 1e9,
    }  # fmt: skip
    result["kernel_gb_s"] = kv_bytes / result["kernel_ms"] / 1e6
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.seqs} decodes, context ~{args.context}, {args.dtype}, {layers} layers, "
        f"{result['threads']} threads "
        f"({result['kv_mb']:.0f} MB of K/V; build: {', '.join(kernels.features) or 'SSE'}"
        f"{'; weight reads between layers' if args.matmul else ''}):\n"
        f"  kernel {result['kernel_ms']:7.2f} ms  {result['kernel_gb_s']:5.1f} GB/s; "
        f"torch.sum reads {result['memory_read_gb_s']:.1f} GB/s"
    )


def timed_sum(t: torch.Tensor) -> float:
    start = time.perf_counter()
    t.sum()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
