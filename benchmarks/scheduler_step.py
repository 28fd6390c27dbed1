"""Scheduler time per step (schedule + update) on a 1000-request trace.

Trace: 1000 requests at step 0, prompt 32..1024 tokens, output 16..512 tokens,
priorities 0..2, 4 shared 256-token system prompts (half the requests). Config: block
16, max_num_seqs 256, max_num_batched_tokens 8192, priority policy, prefix caching
on, swap pool on (auto preemption). Two pools: ample (never preempts) and scarce
(forces preemption). The fake worker costs nothing and is not timed.

    .venv/bin/python benchmarks/scheduler_step.py [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from scheduler_svc.simulator import Simulation
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig

POOLS = {"ample": (32768, 0), "scarce": (2048, 8192)}


def run_once(num_gpu_blocks: int, num_cpu_blocks: int, seed: int) -> dict:
    trace = generate_trace(500, seed=seed, priorities=(0, 1, 2), id_prefix="private-")
    trace += generate_trace(
        500,
        seed=seed + 1,
        priorities=(0, 1, 2),
        shared_prefixes=4,
        shared_prefix_len=256,
        id_prefix="shared-",
    )
    cfg = SchedulerConfig(
        block_size=16,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        policy="priority",
        enable_prefix_caching=True,
        preemption_mode="auto",
    )
    sim = Simulation(trace, cfg, check_invariants=False)
    running: list[int] = []
    started = time.perf_counter()
    result = sim.run(lambda record: running.append(record["num_running"]))
    wall = time.perf_counter() - started
    summary = result.summary
    return {
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": num_cpu_blocks,
        "steps": summary["steps"],
        "mean_running": statistics.fmean(running),
        "step_ms_mean": summary["step_time_us"]["mean"] / 1e3,
        "step_ms_p50": summary["step_time_us"]["p50"] / 1e3,
        "step_ms_p99": summary["step_time_us"]["p99"] / 1e3,
        "preemptions": summary["preemptions"],
        "generated_tokens": summary["generated_tokens"],
        "sim_wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per pool; best mean kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    for name, (gpu, cpu) in POOLS.items():
        runs = [run_once(gpu, cpu, args.seed) for _ in range(args.repeat)]
        results[name] = min(runs, key=lambda r: r["step_ms_mean"])
    if args.json:
        print(json.dumps(results, indent=2))
        return
    header = ("pool", "steps", "running", "mean ms", "p50 ms", "p99 ms")
    print("{:8} {:>6} {:>8} {:>8} {:>7} {:>7}  preemptions".format(*header))
    for name, r in results.items():
        print(
            f"{name:8} {r['steps']:6d} {r['mean_running']:8.1f} {r['step_ms_mean']:8.3f} "
            f"{r['step_ms_p50']:7.3f} {r['step_ms_p99']:7.3f}  {r['preemptions']}"
        )


if __name__ == "__main__":
    main()
