"""In-process engine throughput (output tokens/s) on the embedded tiny model.

64 requests at once, prompts 16..128 tokens, 32..64 output tokens with ignore_eos,
greedy; max_num_seqs 64, max_num_batched_tokens 2048. Reports where the wall time
went: scheduler (schedule + update), worker swap/forward/sample.

    .venv/bin/python benchmarks/engine_throughput.py [--device cpu|cuda] [--no-cuda-graphs] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from expeditor.llm import LLM
from ipc.schema import BatchPlan, StepResult
from shared.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: tiny model)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=2048,
        help="KV blocks (default 2048, on CUDA too: sizing the tiny model's cache from "
        "free GPU memory gives tens of millions of blocks and gigabytes of bookkeeping); "
        "0 = from gpu_memory_utilization (CUDA)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run every step eagerly (CUDA; by default decode steps replay CUDA graphs)",
    )
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [
        [1] + [rng.randrange(3, 259) for _ in range(rng.randint(16, 128))]
        for _ in range(args.num_requests)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(32, 64), ignore_eos=True)
        for _ in prompts
    ]
    with LLM(
        args.model,
        device=args.device,
        num_gpu_blocks=args.num_gpu_blocks or None,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        cuda_graphs=not args.no_cuda_graphs,
    ) as llm:
        llm.generate(prompts[:2], params[:2])  # warm-up
        worker_s = {"swap": 0.0, "forward": 0.0, "sample": 0.0}
        inner = llm.runner.execute

        def execute(plan: BatchPlan) -> StepResult:
            result = inner(plan)
            worker_s["swap"] += result.timing.swap_s
            worker_s["forward"] += result.timing.forward_s
            worker_s["sample"] += result.timing.sample_s
            return result

        llm.runner.execute = execute  # type: ignore[method-assign]
        steps_before = llm.scheduler.step
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - started
        steps = llm.scheduler.step - steps_before
    generated = sum(len(o.token_ids) for o in outputs)
    worker_total = sum(worker_s.values())
    result = {
        "device": args.device,
        "cuda_graphs": llm.runner.graphs is not None,
        "requests": len(prompts),
        "output_tokens": generated,
        "steps": steps,
        "wall_s": wall,
        "output_tokens_per_s": generated / wall,
        "worker_s": worker_s,
        "scheduler_and_glue_s": wall - worker_total,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{generated} output tokens in {wall:.2f} s over {steps} steps: "
        f"{generated / wall:.0f} tokens/s on {args.device}"
        f"{' (CUDA graphs)' if result['cuda_graphs'] else ''}\n"
        f"worker: forward {worker_s['forward']:.2f} s, sample {worker_s['sample']:.2f} s, "
        f"swap {worker_s['swap']:.3f} s; scheduler + engine glue "
        f"{wall - worker_total:.2f} s"
    )


if __name__ == "__main__":
    main()
