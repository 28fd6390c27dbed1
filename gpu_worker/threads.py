"""How many torch threads a CPU worker runs its steps on.

The scheduler daemon shares the machine with the workers. A small model's step is a
chain of tiny ops that a second thread does not speed up, while the thread it takes
competes with the scheduler (and, on a 2-core machine, slows every step down); a
heavier model's matmuls do scale. So, unless ``cpu_threads`` is set, the worker times
a decode forward of its own model on every core and on all but one, and takes every
core only when that is clearly faster (:data:`ALL_CORES_GAIN`). Timings taken while
other processes were busy (the scheduler starting up, a client) say nothing about the
threads, so a measurement during which others used more than :data:`QUIET_SHARE` of a
core is repeated, up to :data:`QUIET_WAIT_S`.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from gpu_worker.model_runner import ModelRunner
from gpu_worker.step_inputs import StepInputs

log = logging.getLogger("expeditor.worker")

ALL_CORES_GAIN = 1.15
"""Every core must make the timed forward this much faster to be chosen: the scheduler
then competes with the step for a core, which the timing alone does not show. On 2
cores (native CPU attention, lean forward) the tiny preset times no faster on both
(served: 31% slower on both), the small preset 1.25x (served: 29% faster on both)."""

QUIET_SHARE = 0.2
"""Other processes' CPU time during a measurement, in cores, above which it is taken again."""
QUIET_WAIT_S = 3.0
"""How long the worker waits for a quiet measurement before using the last one."""

CALIBRATION_SEQS = 64
CALIBRATION_CONTEXT = 128


def decode_inputs(runner: ModelRunner) -> StepInputs:
    """A decode step of up to 64 sequences at context 128 over the runner's own cache
    (the K/V it writes land in blocks no sequence holds yet)."""
    bs, groups = runner.block_size, runner.num_groups  # a table: every group's blocks
    logical = runner.num_gpu_blocks // groups
    per_seq = -(-(CALIBRATION_CONTEXT + 1) // bs)
    num_seqs = max(1, min(CALIBRATION_SEQS, logical // per_seq))
    per_seq = min(per_seq, logical // num_seqs)
    context = min(CALIBRATION_CONTEXT, per_seq * bs - 1)
    own = per_seq * groups
    return StepInputs(
        token_ids=[0] * num_seqs,
        starts=[context] * num_seqs,
        tables=[list(range(i * own, (i + 1) * own)) for i in range(num_seqs)],
        query_start_loc=list(range(num_seqs + 1)),
    )


def time_forward(runner: ModelRunner, inputs: StepInputs, threads: int) -> float:
    """Seconds of one forward of ``inputs`` on ``threads`` torch threads."""
    torch.set_num_threads(threads)
    started = time.perf_counter()
    runner.forward_only(inputs)
    return time.perf_counter() - started


def fastest_forwards(
    runner: ModelRunner, inputs: StepInputs, counts: tuple[int, ...], repeats: int = 15
) -> dict[int, float]:
    """The fastest of ``repeats`` forwards on each thread count, the counts taking turns
    (after two warm-ups each), so that a burst of load elsewhere slows both alike."""
    best = {count: float("inf") for count in counts}
    for index in range(repeats + 2):
        for count in counts:
            elapsed = time_forward(runner, inputs, count)
            if index >= 2:
                best[count] = min(best[count], elapsed)
    return best


def choose_cpu_threads(runner: ModelRunner, configured: int = 0) -> int:
    """Set and return the step thread's torch thread count (call on the step thread:
    torch keeps the count per thread)."""
    cores = os.cpu_count() or 1
    spare = max(1, cores - 1)
    if configured:
        threads = configured
    elif cores == 1:
        threads = 1
    else:
        inputs = decode_inputs(runner)
        deadline = time.monotonic() + QUIET_WAIT_S
        while True:
            before = _cpu_seconds()
            started = time.monotonic()
            best = fastest_forwards(runner, inputs, (spare, cores))
            others = _others_cores(before, _cpu_seconds(), time.monotonic() - started)
            if others is None or others <= QUIET_SHARE or time.monotonic() > deadline:
                break
            log.info("other processes used %.1f cores while timing: again", others)
            time.sleep(0.5)
        spare_s, all_s = best[spare], best[cores]
        threads = cores if spare_s >= ALL_CORES_GAIN * all_s else spare
        log.info(
            "decode forward of %d sequences: %.2f ms on %d threads, %.2f ms on %d",
            len(inputs.starts),
            spare_s * 1e3,
            spare,
            all_s * 1e3,
            cores,
        )
    torch.set_num_threads(threads)
    log.info("CPU worker: %d torch threads of %d cores", threads, cores)
    return threads


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds used by the whole machine, by this process), or None without /proc."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()[1:]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    busy = sum(int(v) for v in fields[:8]) - int(fields[3]) - int(fields[4])  # not idle/iowait
    usage = os.times()
    return busy / ticks, usage.user + usage.system


def _others_cores(
    before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float
) -> float | None:
    """Cores' worth of CPU time other processes used between two readings."""
    if before is None or after is None or wall_s <= 0:
        return None
    machine = after[0] - before[0]
    mine = after[1] - before[1]
    return max(0.0, machine - mine) / wall_s
