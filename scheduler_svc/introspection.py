"""The scheduler's introspection: invariant checks (tests, the simulator, inspect) and
the state snapshot that ``expeditor inspect`` shows. A mixin of :class:`Scheduler`,
kept apart from the step logic."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipc.schema import BlockUsage, PrefixCacheStats, SchedulerSnapshot, SeqInfo
from scheduler_svc.request import SeqStatus

if TYPE_CHECKING:
    from scheduler_svc.kv_manager import KVCacheManager
    from scheduler_svc.queues import SeqQueue
    from scheduler_svc.request import Sequence
    from shared.config import SchedulerConfig


class IntrospectionMixin:
    config: SchedulerConfig
    kv: KVCacheManager
    block_size: int
    running: list[Sequence]
    waiting: SeqQueue
    swapped: SeqQueue
    seqs: dict[str, Sequence]
    step: int
    preemptions: dict[str, int]
    finished_counts: dict[str, int]
    _cpu_release: list[int]
    _last_plan_tokens: int
    _running_forks: int

    def check_invariants(self) -> list[str]:
        """Every violated invariant, as a sentence; empty when the state is consistent."""
        problems: list[str] = []
        cfg = self.config
        refs = [0] * self.kv.pool.num_blocks
        cpu_held = list(self._cpu_release)
        in_queues: dict[str, str] = {}
        groups = (
            ("running", self.running, SeqStatus.RUNNING),
            ("waiting", list(self.waiting), SeqStatus.WAITING),
            ("swapped", list(self.swapped), SeqStatus.SWAPPED),
        )
        for name, seqs, status in groups:
            for seq in seqs:
                if seq.seq_id in in_queues:
                    problems.append(f"{seq.seq_id} is in {in_queues[seq.seq_id]} and {name}")
                in_queues[seq.seq_id] = name
                if seq.status is not status:
                    problems.append(f"{seq.seq_id} is in {name} with status {seq.status.value}")
                for block in seq.block_table:
                    refs[block] += 1
                cpu_held.extend(seq.cpu_block_table)
                if not 0 <= seq.num_computed_tokens <= seq.num_tokens:
                    problems.append(f"{seq.seq_id}: computed {seq.num_computed_tokens} tokens")
                if status is SeqStatus.RUNNING:
                    covered = len(seq.block_table) * self.block_size
                    if covered < seq.num_computed_tokens:
                        problems.append(f"{seq.seq_id}: blocks do not cover computed tokens")
                elif seq.block_table:
                    problems.append(f"{seq.seq_id} holds device blocks while {name}")
                if status is not SeqStatus.SWAPPED and seq.cpu_block_table:
                    problems.append(f"{seq.seq_id} holds CPU blocks while {name}")
        if set(in_queues) != set(self.seqs):
            problems.append("live sequences and queued sequences differ")
        if [s.key for s in self.running] != sorted(s.key for s in self.running):
            problems.append("running sequences are out of queue order")
        slots = sum(s.slots_needed for s in self.running)
        if slots != len(self.running) + self._running_forks:
            problems.append(
                f"running slots counted {len(self.running) + self._running_forks}, actual {slots}"
            )
        if slots > cfg.max_num_seqs:
            problems.append(f"more than max_num_seqs={cfg.max_num_seqs} running")
        if self._last_plan_tokens > cfg.max_num_batched_tokens:
            problems.append(f"last plan scheduled {self._last_plan_tokens} tokens")
        problems += self.kv.pool.check(refs)
        problems += self.kv.cpu_pool.check(cpu_held)
        return problems

    def snapshot(self) -> SchedulerSnapshot:
        pool = self.kv.pool
        seqs = [
            SeqInfo(
                seq_id=seq.seq_id,
                request_id=seq.request.request_id,
                state=seq.status.value,
                priority=seq.request.priority,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                num_computed_tokens=seq.num_computed_tokens,
                num_gpu_blocks=len(seq.block_table),
                num_cpu_blocks=len(seq.cpu_block_table),
                num_preemptions=seq.num_preemptions,
            )
            for seq in (*self.running, *self.swapped, *self.waiting)
        ]
        return SchedulerSnapshot(
            step=self.step,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            gpu_blocks=BlockUsage(
                total=pool.num_blocks, free=pool.num_free, cached=pool.num_cached_free
            ),
            cpu_blocks=BlockUsage(
                total=self.kv.cpu_pool.num_blocks, free=self.kv.cpu_pool.num_free
            ),
            prefix_cache=PrefixCacheStats(
                queried_tokens=self.kv.queried_tokens, hit_tokens=self.kv.hit_tokens
            ),
            preemptions=dict(self.preemptions),
            finished=dict(self.finished_counts),
            seqs=seqs,
        )
