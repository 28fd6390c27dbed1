"""Per-rank memory of tensor parallelism: weights and KV cache at TP=1 and TP=N.

For each checkpoint (the ``small`` llama preset unless ``--model`` is given), spawns the
ranks of a group (torch.multiprocessing, a free localhost port; gloo and one torch thread
per rank on CPU, NCCL and one GPU per rank on CUDA), builds a :class:`ModelRunner` in
each with the same ``num_gpu_blocks``, and reports per rank:

* parameter bytes: ``numel * element_size`` summed over ``model.parameters()``;
* storage bytes: the parameters' storages (``untyped_storage().nbytes()``), each counted
  once by its ``data_ptr``. Equal to the parameter bytes unless a shard is a view that
  keeps its full tensor alive, which this would show (and the exit status is then 1);
* KV cache bytes (``runner.kv_cache.kv``) and, on CUDA, ``torch.cuda.memory_allocated``;
* both ratios to TP=1.

Each rank also runs a prefill and a few greedy decode steps through
``runner.forward_only`` over its paged cache, to show that the sharded model works: every
rank of a group must pick the same tokens, and on CPU (float32) the same as TP=1; on CUDA
(bfloat16, partial sums rounded before the all-reduce) a difference is reported only.

    .venv/bin/python benchmarks/tp_memory.py                       # small llama, CPU
    .venv/bin/python benchmarks/tp_memory.py --model CKPT --sizes 1,2,4
    python benchmarks/tp_memory.py --device cuda                   # needs >= 2 GPUs
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_worker.group import join_group
from gpu_worker.model_runner import ModelRunner, resolve_device, use_device
from gpu_worker.step_inputs import StepInputs
from gpu_worker.tiny_model import make_tiny_model
from scheduler_svc.launch import free_port
from shared.worker_settings import WorkerSettings

PROMPT = [1, *range(40, 63)]  # BOS + 23 byte tokens
NEW_TOKENS = 8
RANK_TIMEOUT_S = 600.0
MIB = 2**20


@dataclass(frozen=True)
class RankReport:
    tp: int
    rank: int
    param_bytes: int
    storage_bytes: int
    kv_bytes: int
    cuda_allocated: int | None
    tokens: list[int]
    last_hidden: list[float]
    build_s: float
    generate_s: float


def weight_bytes(runner: ModelRunner) -> tuple[int, int]:
    """(parameter bytes, bytes of the distinct storages behind the parameters). A bf16
    lean forward on a CPU holds its projections reordered for oneDNN (opaque tensors,
    a storage each) and leaves the modules' weights on the meta device: those count."""
    params = 0
    storages: dict[tuple[str, int], int] = {}
    for p in runner.model.parameters():
        if p.is_meta:
            continue
        params += p.numel() * p.element_size()
        storage = p.untyped_storage()
        storages["dense", storage.data_ptr()] = storage.nbytes()
    if runner.lean is not None and runner.lean.unpacked is None:
        for w in runner.lean.projection_weights():
            params += w.numel() * w.element_size()
            storages["packed", id(w)] = w.numel() * w.element_size()
    return params, sum(storages.values())


def greedy(runner: ModelRunner, prompt: list[int], new_tokens: int) -> tuple[list[int], Any]:
    """Prefill ``prompt`` then decode ``new_tokens`` greedily over the paged cache:
    (the tokens, the prefill's last hidden row on the CPU)."""
    block = runner.block_size
    table = list(range(-(-(len(prompt) + new_tokens) // block)))
    hidden = runner.forward_only(
        StepInputs(token_ids=prompt, starts=[0], tables=[table], query_start_loc=[0, len(prompt)])
    )
    last = hidden[-1].float().cpu()
    tokens: list[int] = []
    position = len(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            token = int(runner.logits(hidden[-1:]).argmax(dim=-1).item())
            tokens.append(token)
            hidden = runner.forward_only(
                StepInputs(
                    token_ids=[token], starts=[position], tables=[table], query_start_loc=[0, 1]
                )
            )
            position += 1
    return tokens, last


def rank_main(
    rank: int,
    size: int,
    port: int,
    model_dir: str,
    device_type: str,
    num_blocks: int,
    block_size: int,
    results: Any,
) -> None:
    """One rank: build the runner, measure, generate, put a RankReport (or the error)."""
    try:
        torch.set_num_threads(1)
        device = resolve_device(device_type, rank)
        use_device(device)
        group = join_group(rank, size, "127.0.0.1", port, device) if size > 1 else None
        started = time.perf_counter()
        settings = WorkerSettings.of(
            model=str(model_dir),
            block_size=block_size,
            max_num_batched_tokens=max(len(PROMPT), 256),
            num_gpu_blocks=num_blocks,
        )
        dtype = torch.float32 if device.type == "cpu" else None  # CUDA: bfloat16 (auto)
        runner = ModelRunner(settings, device=device, dtype=dtype, group=group)
        built = time.perf_counter()
        params, storage = weight_bytes(runner)
        kv = runner.kv_cache.kv
        kv_bytes = kv.untyped_storage().nbytes()
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        tokens, last = greedy(runner, PROMPT, NEW_TOKENS)
        generated = time.perf_counter()
        results.put(
            RankReport(
                tp=size,
                rank=rank,
                param_bytes=params,
                storage_bytes=storage,
                kv_bytes=kv_bytes,
                cuda_allocated=allocated,
                tokens=tokens,
                last_hidden=last.tolist(),
                build_s=built - started,
                generate_s=generated - built,
            )
        )
        if group is not None:
            dist.barrier(group)
            dist.destroy_process_group()
    except Exception:
        results.put(f"rank {rank} of {size}: {traceback.format_exc()}")
        sys.exit(1)


def run_group(
    size: int, model_dir: str, device_type: str, num_blocks: int, block_size: int
) -> list[RankReport]:
    """Spawn ``size`` ranks and collect their reports, rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(rank, size, port, model_dir, device_type, num_blocks, block_size, results),
            daemon=True,
        )
        for rank in range(size)
    ]
    for proc in procs:
        proc.start()
    reports: dict[int, RankReport] = {}
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while len(reports) < size:
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"TP={size}: a rank exited with {dead}" if dead else f"TP={size}: timeout"
                    ) from None
                continue
            if isinstance(item, str):
                raise RuntimeError(item)
            reports[item.rank] = item
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [reports[r] for r in range(size)]


def measure(
    name: str,
    model_dir: str,
    sizes: list[int],
    device_type: str,
    num_blocks: int,
    block_size: int,
) -> bool:
    """Print one checkpoint's table and ratio lines; False if a check failed."""
    groups = {n: run_group(n, model_dir, device_type, num_blocks, block_size) for n in sizes}
    base = groups[1][0]
    ok = True
    alloc = device_type == "cuda"
    print(f"\n{name}")
    print(f"device {device_type}, num_gpu_blocks {num_blocks}, block_size {block_size}")
    header = (
        f"{'TP':>3} {'rank':>4} {'params MiB':>11} {'storage MiB':>12} {'KV MiB':>9}"
        f" {'params/TP1':>10} {'KV/TP1':>7}"
        + (f" {'alloc MiB':>10}" if alloc else "")
        + f" {'build s':>8} {'gen s':>6}  tokens"
    )
    print(header)
    print("-" * len(header))
    for n, reports in groups.items():
        for r in reports:
            line = (
                f"{n:>3} {r.rank:>4} {r.param_bytes / MIB:>11.3f} {r.storage_bytes / MIB:>12.3f}"
                f" {r.kv_bytes / MIB:>9.3f} {r.param_bytes / base.param_bytes:>10.3f}"
                f" {r.kv_bytes / base.kv_bytes:>7.3f}"
            )
            if alloc:
                line += f" {(r.cuda_allocated or 0) / MIB:>10.1f}"
            print(f"{line} {r.build_s:>8.2f} {r.generate_s:>6.2f}  {r.tokens}")
    for n, reports in groups.items():
        if n == 1:
            continue
        params = max(r.param_bytes for r in reports) / base.param_bytes
        kv = max(r.kv_bytes for r in reports) / base.kv_bytes
        diff = max(
            abs(a - b)
            for r in reports
            for a, b in zip(r.last_hidden, base.last_hidden, strict=True)
        )
        agree = all(r.tokens == reports[0].tokens for r in reports)
        same = reports[0].tokens == base.tokens
        print(
            f"ratio TP={n}/TP=1 per rank: params {params:.3f}x, KV {kv:.3f}x "
            f"(ideal {1 / n:.3f}x; params above it by the replicated embedding, head "
            f"and norms); ranks agree on tokens: {'yes' if agree else 'NO'}; "
            f"tokens vs TP=1: {'identical' if same else 'DIFFER'}; "
            f"prefill last hidden max |diff| vs TP=1: {diff:.2e}"
        )
        ok &= agree and (same or device_type == "cuda")
    leaked = [
        (n, r.rank) for n, rs in groups.items() for r in rs if r.storage_bytes > r.param_bytes
    ]
    if leaked:
        print(f"storages larger than the parameters (a shard keeps its full tensor): {leaked}")
        ok = False
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="checkpoint dir (repeatable); default: the small llama preset",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", default="1,2", help="TP sizes, comma-separated (1 is added)")
    parser.add_argument("--num-gpu-blocks", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    if args.device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < max(sizes):
            print(
                f"tp_memory: --device cuda needs {max(sizes)} CUDA devices (one per rank), "
                f"found {count}",
                file=sys.stderr,
            )
            return 2
    ok = True
    with tempfile.TemporaryDirectory(prefix="tp_memory-") as tmp:
        models = [(m, m) for m in args.model]
        if not models:
            small = make_tiny_model(Path(tmp) / "small-llama", arch="llama", size="small")
            models = [("small llama preset", str(small))]
        for name, model_dir in models:
            try:
                ok &= measure(
                    name, model_dir, sizes, args.device, args.num_gpu_blocks, args.block_size
                )
            except RuntimeError as exc:
                print(f"tp_memory: {name}: {exc}", file=sys.stderr)
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
