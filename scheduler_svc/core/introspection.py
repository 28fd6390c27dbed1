"""The scheduler's introspection: invariant checks (tests, the simulator, inspect) and
the state snapshot that ``expeditor inspect`` shows, read from a :class:`Scheduler`
and kept apart from its step logic."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipc.schema import BlockUsage, PrefixCacheStats, SchedulerSnapshot, SeqInfo, SeqStatus

if TYPE_CHECKING:
    from scheduler_svc.core.request import Sequence
    from scheduler_svc.core.scheduler import Scheduler


def check_invariants(scheduler: Scheduler) -> list[str]:
    """Every violated invariant, as a sentence; empty when the state is consistent."""
    problems: list[str] = []
    cfg = scheduler.config
    refs = [0] * scheduler.kv.pool.num_blocks
    cpu_held = list(scheduler.cpu_release)
    in_queues: dict[str, str] = {}
    proposed_in_flight = {
        seq_id: len(proposal)
        for step in scheduler.inflight
        for seq_id, proposal in step.proposals.items()
    } | {seq_id: drafted for step in scheduler.inflight for seq_id, drafted in step.drafts.items()}
    groups = (
        ("running", scheduler.running, SeqStatus.RUNNING),
        ("waiting", list(scheduler.waiting), SeqStatus.WAITING),
        ("swapped", list(scheduler.swapped), SeqStatus.SWAPPED),
    )
    stride = scheduler.kv.num_groups
    constrained = sum(seq.constraint is not None for seq in scheduler.seqs.values())
    if constrained != scheduler.num_constrained:
        problems.append(f"{constrained} constrained sequences, counted {scheduler.num_constrained}")
    for name, seqs, status in groups:
        for seq in seqs:
            if seq.seq_id in in_queues:
                problems.append(f"{seq.seq_id} is in {in_queues[seq.seq_id]} and {name}")
            in_queues[seq.seq_id] = name
            if seq.status is not status:
                problems.append(f"{seq.seq_id} is in {name} with status {seq.status.value}")
            released = seq.num_released
            for block in _held(scheduler, seq):
                refs[block] += 1
            if released or (stride > 1 and scheduler.kv.window and seq.block_table):
                problems += _released_problems(scheduler, seq)
            cpu_held.extend(seq.cpu_block_table)
            proposed = proposed_in_flight.get(seq.seq_id, 0)
            if not 0 <= seq.num_computed_tokens <= seq.num_tokens + seq.num_placeholders + proposed:
                problems.append(f"{seq.seq_id}: computed {seq.num_computed_tokens} tokens")
            if seq.num_placeholders and not scheduler.inflight:
                problems.append(f"{seq.seq_id}: placeholders with no step in flight")
            if status is SeqStatus.RUNNING:
                needed = -(-seq.num_computed_tokens // scheduler.block_size) * stride
                if len(seq.block_table) != needed:
                    problems.append(
                        f"{seq.seq_id}: {len(seq.block_table)} blocks for "
                        f"{seq.num_computed_tokens} computed tokens"
                    )
            elif seq.block_table:
                problems.append(f"{seq.seq_id} holds device blocks while {name}")
            if status is not SeqStatus.SWAPPED and seq.cpu_block_table:
                problems.append(f"{seq.seq_id} holds CPU blocks while {name}")
    if set(in_queues) != set(scheduler.seqs):
        problems.append("live sequences and queued sequences differ")
    if [s.key for s in scheduler.running] != sorted(s.key for s in scheduler.running):
        problems.append("running sequences are out of queue order")
    slots = sum(s.slots_needed for s in scheduler.running)
    if slots != scheduler.num_running_slots:
        problems.append(f"running slots counted {scheduler.num_running_slots}, actual {slots}")
    if slots > cfg.max_num_seqs:
        problems.append(f"more than max_num_seqs={cfg.max_num_seqs} running")
    if scheduler.last_plan_tokens > cfg.max_num_batched_tokens:
        problems.append(f"last plan scheduled {scheduler.last_plan_tokens} tokens")
    problems += scheduler.kv.pool.check(refs)
    host = scheduler.kv.host
    if host is not None:
        cpu_held.extend(host.blocks)
        problems += host.check([block for step in scheduler.inflight for block in step.host_pins])
    problems += scheduler.kv.cpu_pool.check(cpu_held)
    return problems


def _released_problems(scheduler: Scheduler, seq: Sequence) -> list[str]:
    """What is wrong with ``seq``'s released entries (sliding windows): the right ones
    name the null block, and only they."""
    kv = scheduler.kv
    released = seq.num_released
    problems = []
    if released and not kv.window:
        problems.append(f"{seq.seq_id}: {released} blocks released with no window")
    if released and seq.status is SeqStatus.WAITING:
        problems.append(f"{seq.seq_id}: {released} blocks released while waiting")
    elif released and released > (seq.num_computed_tokens - kv.window + 1) // scheduler.block_size:
        problems.append(
            f"{seq.seq_id}: {released} blocks released, some still in the window of "
            f"{seq.num_computed_tokens} computed tokens"
        )
    table, null = seq.block_table, kv.null_block
    # Per entry, whether it is released: a windowed group's of a released block.
    windowed = set(getattr(kv, "windowed", (0,)))
    stride = kv.num_groups
    for index, block in enumerate(table):
        if (index // stride < released and index % stride in windowed) != (block == null):
            what = "a released entry names a block" if block != null else "the null block held"
            problems.append(f"{seq.seq_id}: {what} (entry {index} of {table})")
            break
    if seq.released_width != len(windowed):
        problems.append(f"{seq.seq_id}: released width {seq.released_width}, not {len(windowed)}")
    return problems


def _held(scheduler: Scheduler, seq: Sequence) -> list[int]:
    """The device blocks ``seq``'s table holds (its entries but the released ones)."""
    if scheduler.kv.num_groups == 1:
        return seq.block_table[seq.num_released :]
    null = scheduler.kv.null_block
    return [block for block in seq.block_table if block != null]


def snapshot(scheduler: Scheduler) -> SchedulerSnapshot:
    """The scheduler's queues, pools, counters and every live sequence."""
    pool = scheduler.kv.pool
    host = scheduler.kv.host
    seqs = [
        SeqInfo(
            seq_id=seq.seq_id,
            request_id=seq.request.request_id,
            state=seq.status,
            priority=seq.request.priority,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_computed_tokens=seq.num_computed_tokens,
            num_gpu_blocks=seq.num_device_blocks,
            num_cpu_blocks=len(seq.cpu_block_table),
            num_preemptions=seq.num_preemptions,
        )
        for seq in (*scheduler.running, *scheduler.swapped, *scheduler.waiting)
    ]
    return SchedulerSnapshot(
        step=scheduler.step,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        gpu_blocks=BlockUsage(
            total=pool.num_blocks, free=pool.num_free, cached=pool.num_cached_free
        ),
        cpu_blocks=BlockUsage(
            total=scheduler.kv.cpu_pool.num_blocks, free=scheduler.kv.cpu_pool.num_free
        ),
        prefix_cache=PrefixCacheStats(
            queried_tokens=scheduler.kv.queried_tokens,
            hit_tokens=scheduler.kv.hit_tokens,
            host_hit_tokens=host.hit_tokens if host is not None else 0,
            host_blocks=len(host.blocks) if host is not None else 0,
            host_cached_blocks=host.num_cached if host is not None else 0,
        ),
        preemptions=dict(scheduler.preemptions),
        finished=dict(scheduler.finished_counts),
        seqs=seqs,
    )
