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

from minimal_scheduler import MinimalScheduler, MinimalSeq

from scheduler_svc.simulator import Simulation, TraceRequest
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig

POOLS = {"ample": (32768, 0), "scarce": (2048, 8192)}


def make_trace(seed: int) -> list[TraceRequest]:
    trace = generate_trace(500, seed=seed, priorities=(0, 1, 2), id_prefix="private-")
    trace += generate_trace(
        500,
        seed=seed + 1,
        priorities=(0, 1, 2),
        shared_prefixes=4,
        shared_prefix_len=256,
        id_prefix="shared-",
    )
    return trace


def run_once(num_gpu_blocks: int, num_cpu_blocks: int, seed: int) -> dict:
    trace = make_trace(seed)
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
        "us_per_token": summary["step_time_us"]["mean"]
        * summary["steps"]
        / summary["generated_tokens"],
    }


def run_minimal(num_gpu_blocks: int, seed: int) -> dict:
    """The baseline on the same trace and pool: schedule + postprocess per step."""
    sim = Simulation(make_trace(seed), SchedulerConfig(num_gpu_blocks=num_gpu_blocks))
    sched = MinimalScheduler(num_gpu_blocks, 16, 256, 8192)
    for req in sim.trace:
        sched.add(MinimalSeq(req.id, sim.prompt_of(req), req.max_tokens))
    times: list[float] = []
    running: list[int] = []
    generated = 0
    while sched.waiting or sched.running:
        started = time.perf_counter()
        batch = sched.schedule()
        scheduled = time.perf_counter() - started
        tokens = [3 + len(seq.tokens) % 1000 for seq in batch]  # the "model", untimed
        started = time.perf_counter()
        sched.postprocess(batch, tokens)
        times.append(scheduled + time.perf_counter() - started)
        running.append(len(sched.running))
        generated += len(batch)
    return {
        "steps": len(times),
        "mean_running": statistics.fmean(running),
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "us_per_token": sum(times) * 1e6 / generated,
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
    minimal_runs = [run_minimal(POOLS["ample"][0], args.seed) for _ in range(args.repeat)]
    minimal = min(minimal_runs, key=lambda r: r["step_ms_mean"])
    ratio = results["ample"]["us_per_token"] / minimal["us_per_token"]
    if args.json:
        print(json.dumps({**results, "minimal": minimal, "ratio_per_token": ratio}, indent=2))
        return
    header = ("pool", "steps", "running", "mean ms", "p50 ms", "p99 ms")
    print("{:8} {:>6} {:>8} {:>8} {:>7} {:>7}  preemptions".format(*header))
    for name, r in results.items():
        print(
            f"{name:8} {r['steps']:6d} {r['mean_running']:8.1f} {r['step_ms_mean']:8.3f} "
            f"{r['step_ms_p50']:7.3f} {r['step_ms_p99']:7.3f}  {r['preemptions']}"
        )
    print(
        f"\nscheduling cost per generated token, ample pool: expeditor "
        f"{results['ample']['us_per_token']:.2f} us, minimal baseline "
        f"{minimal['us_per_token']:.2f} us (ratio {ratio:.2f}); baseline mean step "
        f"{minimal['step_ms_mean']:.3f} ms over {minimal['steps']} steps, "
        f"{minimal['mean_running']:.1f} running"
    )


if __name__ == "__main__":
    main()
